"""Backups in an S3-compatible bucket (``s3://bucket/prefix``), through boto3 (the ``backup`` extra).

Where the bucket is and who may write it come from the environment or a credentials file, never from the
destination URL (which a shell history, a process list or a manifest would show):

- endpoint: ``CELLSTREAM_S3_ENDPOINT``, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else AWS itself;
  a custom endpoint (S3Proxy, MinIO, Ceph...) is addressed path-style (``http://host/bucket/key``);
- region: ``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else ``us-east-1``;
- credentials: ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``), else the profile
  ``AWS_PROFILE`` (default ``default``) of the credentials file ``AWS_SHARED_CREDENTIALS_FILE`` (default
  ``~/.aws/credentials``).

botocore's errors stop here: each call raises :class:`~logstore.errors.BackupNotFoundError` for a missing
object, :class:`~logstore.errors.StorageUnavailableError` (retriable) when the server cannot be reached or
fails (5xx, after botocore's own retries), :class:`~logstore.errors.AuthenticationError` when it refuses the
credentials and :class:`~logstore.errors.ConfigurationError` when the bucket does not exist. No message holds
the secret key.
"""

from __future__ import annotations

import configparser
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from logstore.backup.objects import BackupStorage, check_name
from logstore.errors import (
    AuthenticationError,
    BackupNotFoundError,
    ConfigurationError,
    InvalidArgumentError,
    LogstoreError,
    StorageError,
    StorageUnavailableError,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

logger = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"
#: Objects this large or larger go up in parts (S3 takes at most 5 GiB in one PUT; S3Proxy, by default,
#: 32 MiB unsigned-chunked); each part is this large but the last. S3's floor for a part is 5 MiB.
MULTIPART_THRESHOLD = 16 * 1024 * 1024
MIN_PART_SIZE = 5 * 1024 * 1024
# Error codes meaning "these credentials may not do this" (the server answers 403 with one of them): what to check.
_REFUSED = {"SignatureDoesNotMatch": "the secret key is not the access key's",
            "InvalidAccessKeyId": "the server knows no such access key",
            "AccessDenied": "the key may not do this in this bucket",
            "InvalidToken": "the session token is not valid", "ExpiredToken": "the session token has expired",
            "AuthorizationHeaderMalformed": "the region signed for is not the bucket's"}
# Codes worth another try later (throttling, a server-side timeout), whatever their HTTP status.
_TRANSIENT = {"SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "ServiceUnavailable", "InternalError",
              "Throttling", "ThrottlingException"}
_BOTO_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class S3Credentials:
    """An access key and its secret (``repr`` hides the secret), and where they were read (for messages)."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    source: str = "the environment"


def credentials_from(env: Mapping[str, str]) -> S3Credentials:
    """The credentials the environment gives: its keys, else a profile of the shared credentials file.

    Args:
        env: the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
            ``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_PROFILE``, ``HOME``).

    Returns:
        The credentials.

    Raises:
        ConfigurationError: only one of the two keys is set, the file named does not exist or lacks the
            profile or its keys, or there are no credentials at all.
    """
    key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key_id and secret:
        return S3Credentials(key_id, secret, env.get("AWS_SESSION_TOKEN") or None)
    if key_id or secret:
        missing = "AWS_SECRET_ACCESS_KEY" if key_id else "AWS_ACCESS_KEY_ID"
        raise ConfigurationError(f"object-storage credentials: {missing} is not set (the other key is)")
    named = env.get("AWS_SHARED_CREDENTIALS_FILE")
    home = env.get("HOME") or str(Path.home())
    path = Path(named).expanduser() if named else Path(home) / ".aws" / "credentials"
    profile = env.get("AWS_PROFILE") or "default"
    if not path.is_file():
        if named:
            raise ConfigurationError(f"object-storage credentials: AWS_SHARED_CREDENTIALS_FILE names {path}, "
                                     "which is not a file")
        raise ConfigurationError("no object-storage credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                 "or AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/credentials)")
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except configparser.Error as exc:
        raise ConfigurationError(f"object-storage credentials: {path} does not parse ({exc.message})") from None
    section = parser[profile] if parser.has_section(profile) else None
    key_id = section.get("aws_access_key_id") if section else None
    secret = section.get("aws_secret_access_key") if section else None
    if not key_id or not secret:
        raise ConfigurationError(f"object-storage credentials: profile [{profile}] of {path} has no "
                                 "aws_access_key_id and aws_secret_access_key")
    token = section.get("aws_session_token") if section else None
    return S3Credentials(key_id, secret, token or None, source=f"profile [{profile}] of {path}")


def endpoint_from(env: Mapping[str, str]) -> str | None:
    """The S3 endpoint the environment names (None: AWS's own, by region).

    Raises:
        InvalidArgumentError: it is not an ``http(s)://host[:port]`` URL, or it holds credentials.
    """
    for name in ("CELLSTREAM_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        endpoint = env.get(name)
        if endpoint:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise InvalidArgumentError(f"{name} must be an http(s)://host[:port] URL, got {endpoint!r}")
            if parts.username or parts.password:
                raise InvalidArgumentError(f"{name} takes no credentials: give them in AWS_ACCESS_KEY_ID/"
                                           "AWS_SECRET_ACCESS_KEY or a credentials file")
            return endpoint.rstrip("/")
    return None


class S3Storage(BackupStorage):
    """Objects under ``prefix`` in an S3 bucket: a put is one PUT (or a multipart upload, completed only once
    every part is in), which S3 makes visible whole or not at all; names are listed page by page."""

    def __init__(self, bucket: str, prefix: str = "", *, credentials: S3Credentials, endpoint: str | None = None,
                 region: str = DEFAULT_REGION, multipart_threshold: int = MULTIPART_THRESHOLD) -> None:
        """Args:
            bucket: the bucket (it must exist: a backup creates no bucket).
            prefix: the ``/``-separated folder the objects go under ("" for the bucket's root).
            credentials: who signs the requests.
            endpoint: an S3-compatible server's URL; None for AWS.
            region: the region signed for.
            multipart_threshold: objects of this size or more are uploaded in parts of this size (>= 5 MiB).

        Raises:
            InvalidArgumentError: a bucket name S3 does not allow, a prefix that is not a relative path, or a
                threshold under 5 MiB.
        """
        if not _BUCKET.fullmatch(bucket):
            raise InvalidArgumentError(f"{bucket!r} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
        prefix = prefix.strip("/")
        if prefix:
            check_name(prefix)
        if multipart_threshold < MIN_PART_SIZE:
            raise InvalidArgumentError(f"multipart_threshold must be at least {MIN_PART_SIZE} bytes (S3's "
                                       f"smallest part), got {multipart_threshold}")
        self.bucket, self.prefix, self.endpoint = bucket, prefix, endpoint
        self.where = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.multipart_threshold = multipart_threshold
        self._credentials = credentials
        self._base = f"{prefix}/" if prefix else ""
        config = botocore.config.Config(
            region_name=region, signature_version="s3v4", connect_timeout=10, read_timeout=120,
            retries={"mode": "standard", "max_attempts": 4},
            # Other servers than AWS seldom resolve bucket.host names: address them as host/bucket.
            s3={"addressing_style": "path" if endpoint else "auto"})
        self._client: S3Client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, aws_access_key_id=credentials.access_key_id,
            aws_secret_access_key=credentials.secret_access_key, aws_session_token=credentials.session_token,
            config=config)

    @classmethod
    def from_url(cls, url: str, *, env: Mapping[str, str] | None = None) -> S3Storage:
        """The storage of ``s3://bucket[/prefix]``, its endpoint, region and credentials from ``env``.

        Args:
            url: the destination.
            env: the environment (default: ``os.environ``); see the module's documentation for the variables.

        Raises:
            InvalidArgumentError: not an ``s3://`` URL, credentials or a query in it, or a bad bucket name.
            ConfigurationError: no usable credentials in ``env``.
        """
        environ = os.environ if env is None else env
        parts = urlsplit(url)
        if parts.scheme != "s3":
            raise InvalidArgumentError(f"not an s3:// destination: {url!r}")
        if parts.username or parts.password or "@" in parts.netloc:
            raise InvalidArgumentError("an s3:// destination takes no credentials in the URL: give them in "
                                       "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a credentials file")
        if parts.query or parts.fragment:
            raise InvalidArgumentError(f"an s3:// destination takes no query or fragment (the endpoint, region "
                                       f"and credentials come from the environment), got {url!r}")
        region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        return cls(parts.netloc, parts.path, credentials=credentials_from(environ), endpoint=endpoint_from(environ),
                   region=region)

    def _key(self, name: str) -> str:
        return self._base + check_name(name)

    def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        try:
            if len(data) < self.multipart_threshold:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=data)
            else:
                self._put_in_parts(key, data)
        except _BOTO_ERRORS as exc:
            raise self._translate(exc, "writing", name) from None
        logger.debug("put %s/%s (%d bytes)", self.where, name, len(data))

    def _put_in_parts(self, key: str, data: bytes) -> None:
        # The object appears only when the upload is completed; a failed one is aborted so that its parts,
        # which the bucket would otherwise keep (and bill), go.
        upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            size = self.multipart_threshold
            parts: list[CompletedPartTypeDef] = []
            for number, start in enumerate(range(0, len(data), size), start=1):
                answer = self._client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload,
                                                  PartNumber=number, Body=data[start:start + size])
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
            self._client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload,
                                                   MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            except _BOTO_ERRORS as exc:
                logger.warning("could not abort the upload of %s/%s: %s", self.where, key, exc)
            raise

    def get(self, name: str) -> bytes:
        key = self._key(name)
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=key)
            # botocore checks the length read against Content-Length (IncompleteReadError otherwise).
            return answer["Body"].read()
        except _BOTO_ERRORS as exc:
            raise self._translate(exc, "reading", name) from None

    def names(self, prefix: str = "") -> list[str]:
        found: list[str] = []
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._base + prefix):
                found.extend(item["Key"][len(self._base):] for item in page.get("Contents", []))
        except _BOTO_ERRORS as exc:
            raise self._translate(exc, "listing", prefix or "*") from None
        return sorted(found)

    def exists(self, name: str) -> bool:
        # A listing, not a HEAD: a HEAD's 404 does not say whether the object or the bucket is missing.
        key = self._key(name)
        try:
            page = self._client.list_objects_v2(Bucket=self.bucket, Prefix=key, MaxKeys=1)
        except _BOTO_ERRORS as exc:
            raise self._translate(exc, "looking up", name) from None
        return any(item["Key"] == key for item in page.get("Contents", []))

    def _translate(self, exc: Exception, doing: str, name: str) -> LogstoreError:
        """botocore's error as logstore's, naming the object, the server and the key id (never the secret)."""
        if isinstance(exc, botocore.exceptions.ClientError):
            return self._client_error(exc, doing, name)
        if isinstance(exc, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                            botocore.exceptions.IncompleteReadError, botocore.exceptions.FlexibleChecksumError)):
            return StorageUnavailableError(self._scrub(f"{doing} {self.where}/{name}: {self._server()} could not "
                                                       f"be reached or did not answer in full ({exc})"))
        if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
            return ConfigurationError(f"{doing} {self.where}/{name}: {exc}")
        return StorageError(self._scrub(f"{doing} {self.where}/{name}: {exc}"))

    def _client_error(self, exc: botocore.exceptions.ClientError, doing: str, name: str) -> LogstoreError:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        said = self._scrub(f"{code}: {error.get('Message', '')}".rstrip(": "))
        if code in ("NoSuchKey", "404"):
            return BackupNotFoundError(f"no {name} in {self.where}")
        if code == "NoSuchBucket":
            return ConfigurationError(f"bucket {self.bucket!r} does not exist at {self._server()}: create it (a "
                                      "backup creates no bucket) or name another in the destination")
        if code in _REFUSED or status in (401, 403):
            why = _REFUSED.get(code, "check the credentials")
            return AuthenticationError(
                f"{doing} {self.where}/{name}: {self._server()} refused the access key "
                f"{self._credentials.access_key_id!r} (from {self._credentials.source}): {why} ({said})")
        if code in _TRANSIENT or status >= 500:
            return StorageUnavailableError(f"{doing} {self.where}/{name}: {self._server()} failed ({said})")
        return StorageError(f"{doing} {self.where}/{name}: {self._server()} answered {status} ({said})")

    def _server(self) -> str:
        return self.endpoint or "S3"

    def _scrub(self, text: str) -> str:
        # Whatever botocore or the server echoed, the secret never leaves this module.
        for secret in (self._credentials.secret_access_key, self._credentials.session_token):
            if secret:
                text = text.replace(secret, "***")
        return text
