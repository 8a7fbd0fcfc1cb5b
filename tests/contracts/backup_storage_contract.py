"""The contract of a backup destination (:class:`logstore.backup.storage.BackupStorage`), written once and run
against each kind: a directory and an S3-compatible bucket (tests/logstore/test_backup_storage.py).

Subclasses provide ``storage_at``: a factory of storages at fresh, empty sibling destinations, by a relative
name (``storage_at("a")`` and ``storage_at("ab")`` are distinct destinations side by side).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from logstore.backup.storage import BackupStorage
from logstore.errors import BackupNotFoundError, InvalidArgumentError

# Larger than an S3 put's single-request threshold (logstore.backup.s3.MULTIPART_THRESHOLD, 16 MiB), and not a
# multiple of a part: the last part is short.
LARGE = 17 * 1024 * 1024 + 1_234_567
# More than one page of an S3 listing (at most 1000 keys a page).
MANY = 1_050
BAD_NAMES = ["", "/abs", "a//b", "a/", "../x", "a/../b", "./a", ".hidden", "a/.partial", "a\nb", "a\x00b"]


class BackupStorageContract:
    @pytest.fixture
    def storage_at(self) -> Callable[[str], BackupStorage]:
        raise NotImplementedError

    @pytest.fixture
    def storage(self, storage_at: Callable[[str], BackupStorage]) -> BackupStorage:
        return storage_at("main")

    def test_round_trip_of_small_empty_and_large_objects(self, storage: BackupStorage) -> None:
        large = os.urandom(LARGE)
        objects = {"b1/manifest.json": b'{"a": 1}', "b1/empty": b"", "b1/chunks/000.bin": large,
                   "b1/binary": bytes(range(256)) * 3}
        for name, data in objects.items():
            storage.put(name, data)
        for name, data in objects.items():
            assert storage.get(name) == data, name
            assert storage.exists(name)
        assert storage.names() == sorted(objects)

    def test_a_put_replaces_the_whole_object(self, storage: BackupStorage) -> None:
        storage.put("state.bin", b"x" * 1000)
        storage.put("state.bin", b"short")
        assert storage.get("state.bin") == b"short"
        assert storage.names() == ["state.bin"]

    def test_names_under_a_prefix_sorted(self, storage: BackupStorage) -> None:
        for name in ["b2/x", "b10/z", "b1/y", "b1/x", "top"]:
            storage.put(name, name.encode())
        assert storage.names() == ["b1/x", "b1/y", "b10/z", "b2/x", "top"]
        assert storage.names("b1/") == ["b1/x", "b1/y"]
        assert storage.names("b1") == ["b1/x", "b1/y", "b10/z"]
        assert storage.names("b3/") == []

    def test_names_of_more_than_a_page(self, storage: BackupStorage) -> None:
        names = [f"b/{i:05d}" for i in range(MANY)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda name: storage.put(name, name.encode()), names))
        storage.put("c/after", b"")
        assert storage.names() == [*names, "c/after"]
        assert storage.names("b/") == names
        assert storage.names("b/009") == names[900:1000]
        assert storage.exists(names[-1]) and storage.get(names[-1]) == names[-1].encode()

    def test_destinations_side_by_side_do_not_see_each_other(self, storage_at: Callable[[str], BackupStorage],
                                                             ) -> None:
        a, ab = storage_at("a"), storage_at("ab")
        a.put("x", b"in a")
        ab.put("x", b"in ab")
        assert (a.names(), ab.names()) == (["x"], ["x"])
        assert (a.get("x"), ab.get("x")) == (b"in a", b"in ab")

    def test_a_missing_name_is_not_found(self, storage: BackupStorage) -> None:
        storage.put("b1/there", b"1")
        with pytest.raises(BackupNotFoundError, match="b1/missing"):
            storage.get("b1/missing")
        assert not storage.exists("b1/missing")
        assert not storage.exists("b1/ther")  # a prefix of a name is no name
        assert storage.names("b2/") == []

    def test_an_empty_destination_has_no_names(self, storage: BackupStorage) -> None:
        assert storage.names() == []
        with pytest.raises(BackupNotFoundError):
            storage.get("manifest.json")

    @pytest.mark.parametrize("name", BAD_NAMES)
    def test_bad_names_are_refused(self, storage: BackupStorage, name: str) -> None:
        with pytest.raises(InvalidArgumentError):
            storage.put(name, b"1")
        with pytest.raises(InvalidArgumentError):
            storage.get(name)
        with pytest.raises(InvalidArgumentError):
            storage.exists(name)
        assert storage.names() == []
