"""Helpers about stores that tests of several subjects share: a cluster file, rows in a given shard, the
SQLite file behind a sqlite:// URL."""

from __future__ import annotations

import uuid
from pathlib import Path

import logstore
from logstore.backends.sqlite.recorder import DB_FILE


def two_nodes(path: Path, urls: list[str], shards: int) -> Path:
    """A cluster file of two nodes splitting ``shards`` in halves."""
    half = shards // 2
    path.write_text(f'shards = {shards}\n[[nodes]]\nname = "a"\nurl = "{urls[0]}"\nshards = "0-{half - 1}"\n'
                    f'[[nodes]]\nname = "b"\nurl = "{urls[1]}"\nshards = "{half}-{shards - 1}"\n')
    return path


def keys_in_shard(store: logstore.Store, shard: int, n: int) -> list[uuid.UUID]:
    """``n`` new row keys that the store puts in ``shard``."""
    out: list[uuid.UUID] = []
    while len(out) < n:
        key = uuid.uuid4()
        if store.shard_of(key) == shard:
            out.append(key)
    return out


def sqlite_file(url: str) -> Path:
    """The database file of the SQLite store at ``sqlite:///<directory>``."""
    return Path(url[len("sqlite:///"):]) / DB_FILE
