"""Where backups are kept: a directory or an object store, behind one small interface of whole named objects
(:mod:`logstore.backup.objects`).

A backup is written as immutable objects (``put`` never overwrites a name with other bytes) under a
destination: a local directory (``/path`` or ``file:///path``) or an S3-compatible bucket
(``s3://bucket/prefix``, :mod:`logstore.backup.s3`). Names are relative, ``/``-separated paths.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from logstore.backup.objects import BackupStorage, check_name
from logstore.errors import BackupNotFoundError, InvalidArgumentError
from logstore.extras import require
from logstore.files import private_dir

# BackupStorage and check_name live in objects.py, which s3.py imports without a cycle; still importable from here.
__all__ = ["BackupStorage", "DirectoryStorage", "check_name", "open_storage"]


class DirectoryStorage(BackupStorage):
    """Objects as files under a directory (created private, 0700); a put writes a temporary file, syncs it and
    renames it into place, so a crash leaves either the whole file or none."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)

    def put(self, name: str, data: bytes) -> None:
        path = self.root / check_name(name)
        private_dir(path.parent)
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)

    def get(self, name: str) -> bytes:
        path = self.root / check_name(name)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise BackupNotFoundError(f"no {name} in {self.where}") from None

    def exists(self, name: str) -> bool:
        return (self.root / check_name(name)).is_file()

    def names(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        names = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(n for n in names if n.startswith(prefix) and not n.rpartition("/")[2].startswith("."))


def open_storage(dest: str, *, env: Mapping[str, str] | None = None) -> BackupStorage:
    """The storage of a destination: a directory (``/path``, ``file:///path``, a relative path) or
    ``s3://bucket/prefix`` (credentials and endpoint from the environment or a file, never the URL).

    Args:
        dest: the destination.
        env: the environment to read credentials from (default: ``os.environ``).

    Raises:
        InvalidArgumentError: an unknown scheme, or credentials in the URL.
        MissingExtraError: ``s3://`` without the ``backup`` extra installed.
    """
    parts = urlsplit(dest)
    if parts.scheme in ("", "file"):
        return DirectoryStorage(Path(parts.path if parts.scheme else dest).expanduser())
    if parts.scheme == "s3":
        if parts.username or parts.password:
            raise InvalidArgumentError("an s3:// destination takes no credentials in the URL: give them in "
                                       "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a credentials file")
        require("backup", "an s3:// backup destination")
        from logstore.backup.s3 import S3Storage  # boto3, imported only for s3:// (the backup extra)

        return S3Storage.from_url(dest, env=os.environ if env is None else env)
    raise InvalidArgumentError(f"unsupported backup destination {dest!r}: use a directory or s3://bucket/prefix")
