"""Helpers about stores that tests of several subjects share: a cluster file, rows in a given shard, the
SQLite file behind a sqlite:// URL."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from pathlib import Path

import logstore
from logstore.backends.sqlite.recorder import DB_FILE


def two_nodes(path: Path, urls: list[str], shards: int) -> Path:
    """A cluster file of two nodes splitting ``shards`` in halves."""
    half = shards // 2
    path.write_text(f'shards = {shards}\n[[nodes]]\nname = "a"\nurl = "{urls[0]}"\nshards = "0-{half - 1}"\n'
                    f'[[nodes]]\nname = "b"\nurl = "{urls[1]}"\nshards = "{half}-{shards - 1}"\n')
    return path


def key_per_shard(store: logstore.Store, shards: Iterable[int]) -> dict[int, uuid.UUID]:
    """A new row key in each of ``shards``: one pass of random keys for them all (about 35,000 for 4096
    shards), where a search per shard would draw about 4096 keys for each."""
    wanted = set(shards)
    out: dict[int, uuid.UUID] = {}
    while len(out) < len(wanted):
        key = uuid.uuid4()
        shard = store.shard_of(key)
        if shard in wanted:
            out.setdefault(shard, key)
    return out


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
