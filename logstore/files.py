"""Files and folders that cellstream creates to hold data are for their owner alone: files are 0600 and folders
0700, whatever the umask. This covers a SQLite store with its ``-wal`` and ``-shm``, a standalone tailer's offsets
and topic files, and a connector's Parquet lake.

The umask can only make them stricter. Something that already exists keeps its mode: a folder the user made (a
lake's root, say) is theirs to open to others. A file that is written under a temporary name and then renamed
over the old one gets the new file's 0600.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_dir(path: str | os.PathLike[str]) -> None:
    """Create the folder ``path`` and any missing parents, each 0700; those that exist are left as they are.

    Args:
        path: the folder.

    Raises:
        OSError: as :meth:`pathlib.Path.mkdir` with ``parents=True, exist_ok=True`` would (e.g. ``path`` is a
            file, or a parent cannot be written).
    """
    folder = Path(path)
    try:
        os.mkdir(folder, PRIVATE_DIR)
    except FileNotFoundError:
        if folder.parent == folder:
            raise
        # Path.mkdir(parents=True) would make the parents with the umask's mode: they hold the data too.
        private_dir(folder.parent)
        private_dir(folder)
    except OSError:
        if not folder.is_dir():
            raise


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that creates a missing file 0600: ``open(path, "a", opener=private_opener)``.
    A file that already exists keeps its mode."""
    return os.open(path, flags, PRIVATE_FILE)


def create_private_file(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` as an empty 0600 file, for a library that creates it with the umask's mode otherwise
    (SQLite, Parquet writers): they open the existing file and keep its mode.

    Args:
        path: the file.

    Returns:
        True when it was created, False when it existed (its mode is left as it is).

    Raises:
        OSError: it cannot be created (e.g. its folder is missing).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return False
    os.close(fd)
    return True
