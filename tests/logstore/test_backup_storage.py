"""Backup destinations: the BackupStorage contract (tests/contracts/backup_storage_contract.py) on a directory and
on a bucket of the real S3-compatible server (S3Proxy, the ``s3_destination`` fixture); and what only object
storage has: credentials and endpoint from the environment or a file and never from the URL, and botocore's
errors turned into logstore's (wrong credentials, a missing bucket, an unreachable server) without the secret."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest

import logstore
from logstore.backup.create import create_backup
from logstore.backup.restore import restore
from logstore.backup.s3 import MULTIPART_THRESHOLD, S3Storage, credentials_from, endpoint_from
from logstore.backup.storage import BackupStorage, DirectoryStorage, open_storage
from logstore.backup.verify import verify_chain
from logstore.errors import (
    AuthenticationError,
    BackupNotFoundError,
    ConfigurationError,
    InvalidArgumentError,
    StorageError,
    StorageUnavailableError,
)
from tests.conftest import S3Destination
from tests.contracts.backup_storage_contract import LARGE, BackupStorageContract
from tests.harness.services import free_port
from tests.harness.shared_servers import s3_admin

WRONG_SECRET = "wrong-secret-0f3a9c"


class TestDirectoryStorage(BackupStorageContract):
    @pytest.fixture
    def storage_at(self, tmp_path: Path) -> Callable[[str], BackupStorage]:
        return lambda name: open_storage(str(tmp_path / "backups" / name))

    def test_a_file_url(self, tmp_path: Path) -> None:
        open_storage(f"file://{tmp_path}/backups").put("b1/x", b"1")
        assert DirectoryStorage(tmp_path / "backups").get("b1/x") == b"1"


class TestS3Storage(BackupStorageContract):
    @pytest.fixture
    def storage_at(self, s3_destination: S3Destination) -> Callable[[str], BackupStorage]:
        return lambda name: open_storage(f"{s3_destination.url}/{name}", env=s3_destination.env)

    def test_a_large_object_goes_up_in_parts(self, s3_destination: S3Destination) -> None:
        data = os.urandom(LARGE)
        assert LARGE > MULTIPART_THRESHOLD  # what the contract's round trip puts takes this path too
        storage = open_storage(s3_destination.url, env=s3_destination.env)
        storage.put("b1/large", data)
        storage.put("b1/small", data[:1000])
        # S3's ETag of a multipart object is "<md5 of the parts' md5s>-<number of parts>".
        head = s3_admin().head_object(Bucket=s3_destination.bucket, Key="backups/b1/large")
        assert head["ETag"].strip('"').endswith("-2") and head["ContentLength"] == LARGE
        assert "-" not in s3_admin().head_object(Bucket=s3_destination.bucket, Key="backups/b1/small")["ETag"]
        assert storage.get("b1/large") == data
        assert s3_admin().list_multipart_uploads(Bucket=s3_destination.bucket).get("Uploads", []) == []

    def test_the_bucket_root_holds_the_prefix(self, s3_destination: S3Destination) -> None:
        root = open_storage(f"s3://{s3_destination.bucket}", env=s3_destination.env)
        under = open_storage(s3_destination.url, env=s3_destination.env)
        under.put("b1/x", b"1")
        assert root.names() == ["backups/b1/x"] and root.get("backups/b1/x") == b"1"
        assert (root.where, under.where) == (f"s3://{s3_destination.bucket}", s3_destination.url)


# -- credentials, endpoint and errors (object storage only) -------------------------------------------------
@pytest.mark.parametrize("url", ["s3://AKIDEXAMPLE:topsecret@bucket/p", "s3://topsecret@bucket/p",
                                 "s3://:topsecret@bucket/p"])
def test_credentials_in_the_url_are_refused(url: str) -> None:
    env = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "CELLSTREAM_S3_ENDPOINT": "http://127.0.0.1:1"}
    openers: list[Callable[[], BackupStorage]] = [lambda: open_storage(url, env=env),
                                                  lambda: S3Storage.from_url(url, env=env)]
    for opener in openers:
        with pytest.raises(InvalidArgumentError, match="no credentials in the URL") as caught:
            opener()
        assert "topsecret" not in str(caught.value)


@pytest.mark.parametrize("url", ["s3://bucket/p?access_key=a&secret_key=b", "s3://bucket/p#x", "s3://UPPER/p",
                                 "s3:///p", "s3://bucket/p/../q", "s3://ab/p"])
def test_other_malformed_destinations_are_refused(url: str) -> None:
    env = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
    with pytest.raises(InvalidArgumentError):
        open_storage(url, env=env)


def test_no_credentials_names_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        credentials_from({"HOME": str(tmp_path)})
    with pytest.raises(ConfigurationError, match="AWS_SECRET_ACCESS_KEY is not set"):
        credentials_from({"AWS_ACCESS_KEY_ID": "a", "HOME": str(tmp_path)})
    with pytest.raises(ConfigurationError, match="not a file"):
        credentials_from({"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")})
    (tmp_path / "creds").write_text("[other]\naws_access_key_id = a\naws_secret_access_key = topsecret\n")
    with pytest.raises(ConfigurationError, match=r"profile \[default\]") as caught:
        credentials_from({"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "creds")})
    assert "topsecret" not in str(caught.value)


def test_the_secret_is_not_in_the_credentials_repr() -> None:
    credentials = credentials_from({"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "topsecret",
                                    "AWS_SESSION_TOKEN": "toptoken"})
    assert "topsecret" not in repr(credentials) and "toptoken" not in repr(credentials)


def test_endpoint_from_the_environment() -> None:
    assert endpoint_from({}) is None
    assert endpoint_from({"AWS_ENDPOINT_URL": "http://b:2/"}) == "http://b:2"
    assert endpoint_from({"AWS_ENDPOINT_URL": "http://b:2", "AWS_ENDPOINT_URL_S3": "http://s:3"}) == "http://s:3"
    assert endpoint_from({"CELLSTREAM_S3_ENDPOINT": "https://a:1", "AWS_ENDPOINT_URL": "http://b:2"}) == "https://a:1"
    for bad in ("ftp://a", "a:1", "http://key:topsecret@a:1"):
        with pytest.raises(InvalidArgumentError) as caught:
            endpoint_from({"CELLSTREAM_S3_ENDPOINT": bad})
        assert "topsecret" not in str(caught.value)


def test_credentials_from_a_shared_credentials_file(s3_destination: S3Destination, tmp_path: Path) -> None:
    env = s3_destination.env
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = nobody\naws_secret_access_key = {WRONG_SECRET}\n\n"
                     f"[backup]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
                     f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")
    # The endpoint through AWS_ENDPOINT_URL this time: the variable every AWS SDK reads.
    from_file = {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_PROFILE": "backup",
                 "AWS_ENDPOINT_URL": env["CELLSTREAM_S3_ENDPOINT"]}
    storage = open_storage(s3_destination.url, env=from_file)
    storage.put("b1/x", b"from the file's profile")
    assert open_storage(s3_destination.url, env=env).get("b1/x") == b"from the file's profile"
    # The default profile's key is unknown to the server: refused, naming the key and the file.
    refused = open_storage(s3_destination.url, env={**from_file, "AWS_PROFILE": ""})
    with pytest.raises(AuthenticationError, match=r"'nobody' \(from profile \[default\] of .*credentials\)"):
        refused.names()


def test_cellstream_s3_endpoint_wins_over_aws_endpoint_url(s3_destination: S3Destination) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    storage = open_storage(s3_destination.url, env={**s3_destination.env, "AWS_ENDPOINT_URL": dead})
    storage.put("x", b"1")
    assert storage.names() == ["x"]


def _operations(storage: BackupStorage) -> list[Callable[[], object]]:
    return [lambda: storage.put("b1/x", b"1"), lambda: storage.get("b1/x"), lambda: storage.names(),
            lambda: storage.exists("b1/x")]


def test_a_wrong_secret_is_an_authentication_error_without_the_secret(s3_destination: S3Destination) -> None:
    storage = open_storage(s3_destination.url, env={**s3_destination.env, "AWS_SECRET_ACCESS_KEY": WRONG_SECRET})
    for operation in _operations(storage):
        with pytest.raises(AuthenticationError) as caught:
            operation()
        message = str(caught.value)
        assert isinstance(caught.value, ConfigurationError) and not caught.value.retriable
        assert f"refused the access key {s3_destination.env['AWS_ACCESS_KEY_ID']!r}" in message
        assert "the secret key is not the access key's (SignatureDoesNotMatch" in message
        assert s3_destination.url in message
        assert WRONG_SECRET not in message and WRONG_SECRET not in repr(caught.value.args)


def test_an_unknown_access_key_is_an_authentication_error(s3_destination: S3Destination) -> None:
    storage = open_storage(s3_destination.url, env={**s3_destination.env, "AWS_ACCESS_KEY_ID": "nobody",
                                                    "AWS_SECRET_ACCESS_KEY": WRONG_SECRET})
    for operation in _operations(storage):
        with pytest.raises(AuthenticationError, match=r"'nobody'.*no such access key \(InvalidAccessKeyId") \
                as caught:
            operation()
        assert WRONG_SECRET not in str(caught.value)


def test_a_missing_bucket_is_a_configuration_error(s3_destination: S3Destination) -> None:
    storage = open_storage(f"s3://{s3_destination.bucket}-none/p", env=s3_destination.env)
    for operation in _operations(storage):
        with pytest.raises(ConfigurationError, match=f"bucket '{s3_destination.bucket}-none' does not exist") \
                as caught:
            operation()
        assert not isinstance(caught.value, (AuthenticationError, BackupNotFoundError))


def test_an_unreachable_server_is_retriable() -> None:
    env = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": WRONG_SECRET,
           "CELLSTREAM_S3_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    storage = open_storage("s3://bucket/p", env=env)
    for operation in _operations(storage):
        with pytest.raises(StorageUnavailableError, match="s3://bucket/p") as caught:
            operation()
        assert caught.value.retriable and WRONG_SECRET not in str(caught.value)


def test_directory_names_hide_partial_files(tmp_path: Path) -> None:
    storage = DirectoryStorage(tmp_path)
    storage.put("b1/x", b"1")
    (tmp_path / "b1" / ".y.partial").write_bytes(b"half")
    assert storage.names() == ["b1/x"]


@pytest.mark.parametrize(("code", "status", "error", "retriable"), [
    ("InternalError", 500, StorageUnavailableError, True), ("SlowDown", 503, StorageUnavailableError, True),
    ("AccessDenied", 403, AuthenticationError, False), ("InvalidRequest", 400, StorageError, False),
])
def test_server_answers_at_the_boundary(code: str, status: int, error: type[Exception], retriable: bool) -> None:
    """Answers the shared S3Proxy gives only when it fails (5xx, throttling) or per policy, translated as the real
    ones above are: botocore's ClientError carrying them, as botocore builds it from an answer."""
    storage = S3Storage("bucket", "p", credentials=credentials_from(
        {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": WRONG_SECRET}), endpoint="http://127.0.0.1:1")
    answer: Any = {"Error": {"Code": code, "Message": f"echoing {WRONG_SECRET}"},
                   "ResponseMetadata": {"HTTPStatusCode": status}}
    translated = storage._translate(botocore.exceptions.ClientError(answer, "GetObject"), "reading", "b1/x")
    assert type(translated) is error and translated.retriable is retriable
    assert code in str(translated) and "s3://bucket/p/b1/x" in str(translated)
    assert WRONG_SECRET not in str(translated)


def test_a_backup_chain_in_a_bucket_restores_id_for_id(s3_destination: S3Destination, tmp_path: Path) -> None:
    """logstore.backup over the real server: a full and an incremental backup into the bucket, verified and
    restored into a new instance with the same cells and added_ids."""
    def cells(store: logstore.Store) -> list[logstore.Cell]:
        return [cell for shard in range(8) for cell in store.get_cells_for_shard(shard, 0, 10_000)[0]]

    storage = open_storage(s3_destination.url, env=s3_destination.env)
    with logstore.open(f"sqlite:///{tmp_path}/source", shards=8) as source:
        source.put_cells([(uuid.uuid4(), "c", 1, {"i": i}) for i in range(300)])
        full = create_backup(source, storage, chunk_shards=3)
        source.put_cells([(uuid.uuid4(), "c", 1, {"i": i}) for i in range(300, 400)])
        incremental = create_backup(source, storage, incremental=True, chunk_shards=3)
        assert incremental.parent_id == full.backup_id and incremental.cells == 100
        chain, problems = verify_chain(storage, incremental.backup_id)
        assert problems == [] and [m.backup_id for m in chain] == [full.backup_id, incremental.backup_id]
        with logstore.open(f"sqlite:///{tmp_path}/target", shards=8) as target:
            assert restore(storage, target).cells == 400
            assert cells(target) == cells(source) and target.heads() == source.heads()
