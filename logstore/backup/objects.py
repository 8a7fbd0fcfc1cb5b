"""The interface of a backup destination: named objects, each written whole, under one place.

A backup is written as immutable objects (``put`` never overwrites a name with other bytes) whose names are
relative, ``/``-separated paths. :mod:`logstore.backup.storage` has the directory kind and opens a destination
by its URL; :mod:`logstore.backup.s3` the S3-compatible one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from logstore.errors import InvalidArgumentError


class BackupStorage(ABC):
    """Named objects under one destination."""

    #: The destination as given, without credentials: what logs and manifests may show.
    where: str

    @abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Store ``data`` as ``name``, whole or not at all (a reader never sees a half-written object)."""

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The bytes of ``name``.

        Raises:
            BackupNotFoundError: no object by that name.
        """

    @abstractmethod
    def names(self, prefix: str = "") -> list[str]:
        """The names under ``prefix``, sorted."""

    def exists(self, name: str) -> bool:
        """Whether ``name`` is stored."""
        return name in self.names(name)


def check_name(name: str) -> str:
    """``name`` if it is a relative ``/``-separated path whose parts do not start with ``.`` (no ``.`` or ``..``;
    a directory destination keeps its partial files under such names) and hold no control character.

    Raises:
        InvalidArgumentError: it is not.
    """
    parts = name.split("/")
    if not name or any(not p or p.startswith(".") for p in parts) or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise InvalidArgumentError(f"a backup object's name must be a relative path of parts not starting with "
                                   f"'.', got {name!r}")
    return name
