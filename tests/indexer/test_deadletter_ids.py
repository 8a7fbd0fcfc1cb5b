"""A dead letter's id: deterministic (a cell that fails again finds its entry), in the app's DLQ shard, and
exactly the uuid5 search it has always been (entries written before keep being found)."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import pytest

import logstore
from indexer.runtime.dlq_store import _NAMESPACE, DeadLetterStore
from logstore.cell import shard_of


def reference(base: str, shard: int, shard_count: int) -> str:
    for n in itertools.count():
        key = uuid.uuid5(_NAMESPACE, f"{base}\x00{n}")
        if shard_of(key, shard_count) == shard:
            return str(key)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("shards", [1, 64, 4096])
def test_ids_are_the_uuid5_search_and_land_in_the_dlq_shard(tmp_path: Path, shards: int) -> None:
    with logstore.open(f"sqlite:///{tmp_path / 's'}", shards) as store:
        for app in ("billing", "trips-ü"):
            letters = DeadLetterStore(store, app)
            for i in range(5):
                row = uuid.uuid4()
                cell = {"row_key": str(row), "column": "BASE", "ref_key": i + 1}
                found = letters.entry_id("bill_rider", cell, {"mode": "direct"})
                assert found == reference(f"{app}\x00bill_rider\x00{row}\x00BASE\x00{i + 1}", letters.shard, shards)
                assert found == letters.entry_id("bill_rider", dict(cell), {"mode": "kafka"})
                assert store.shard_of(found) == letters.shard
            source = {"topic": "cells.BASE", "partition": 3, "offset": 17}
            assert letters.entry_id("h", {}, source) == reference(
                f"{app}\x00h\x00offset=17,partition=3,topic=cells.BASE", letters.shard, shards)
