"""Positions as an operator writes them (logstore/positions.py): parsed, refused with the problem named, and
resolved against a real store."""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest

import logstore
from logstore.errors import InvalidArgumentError
from logstore.positions import Position, parse_position, parse_shards, resolve_positions


def test_shard_sets() -> None:
    assert parse_shards("0-3,7, 5,2", 8) == [0, 1, 2, 3, 5, 7]
    for text, problem in (("x", "neither a shard"), ("3-1", "not a range"), ("-1", "neither a shard"),
                          ("0-8", "8 is out of range"), ("", "neither a shard")):
        with pytest.raises(InvalidArgumentError, match=problem):
            parse_shards(text, 8)


def test_position_forms() -> None:
    assert parse_position("beginning") == Position("beginning")
    assert parse_position("now") == parse_position("end") == Position("end")
    assert parse_position("3:10,0:5") == Position("locations", locations={3: 10, 0: 5})
    assert str(parse_position("3:10,0:5")) == "0:5,3:10"  # what `offsets show` prints, given back
    when = parse_position("2026-11-24T09:00:00Z")
    assert when.kind == "time" and when.when == dt.datetime(2026, 11, 24, 9, tzinfo=dt.UTC)
    for text, problem in (("2026-11-24T09:00:00", "has no zone"), ("yesterday", "is not beginning"),
                          ("1:2,1:3", "given twice")):
        with pytest.raises(InvalidArgumentError, match=problem):
            parse_position(text)


def test_resolved_against_a_store(sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=4) as store:
        early = store.put_cells([(uuid.uuid4(), "A", 1, {}) for _ in range(20)])
        time.sleep(0.02)
        cut = dt.datetime.now(dt.UTC)
        time.sleep(0.02)
        late = store.put_cells([(uuid.uuid4(), "A", 1, {}) for _ in range(20)])
        heads = store.heads()
        assert resolve_positions(store, parse_position("beginning")) == dict.fromkeys(range(4), 0)
        assert resolve_positions(store, parse_position("end"), [1, 2]) == {1: heads[1], 2: heads[2]}
        at = resolve_positions(store, Position("time", when=cut))
        for shard in range(4):  # reading after each location yields exactly the late cells
            page, _ = store.get_cells_for_shard(shard, at[shard], 1000)
            assert [c.added_id for c in page] == [c.added_id for c in late if c.shard == shard]
        assert early
        assert resolve_positions(store, parse_position("2:1")) == {2: 1}
        with pytest.raises(InvalidArgumentError, match="past the shard's head"):
            resolve_positions(store, Position("locations", locations={2: heads[2] + 1}))
        with pytest.raises(InvalidArgumentError, match="not among the shards chosen"):
            resolve_positions(store, parse_position("2:1"), [0])
