"""The store coordinator (offsets in the logstore itself, the default of direct-mode apps)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import logstore
from tailer.coordinators.store import StoreCoordinator
from tailer.interfaces import Offset


@contextmanager
def started(store: logstore.Store, consumer: str) -> Iterator[StoreCoordinator]:
    """A started coordinator, stopped at the end: its reset-checking thread must not outlive the store."""
    coordinator = StoreCoordinator(store, consumer)
    coordinator.start(lambda: None)
    try:
        yield coordinator
    finally:
        coordinator.stop()


def test_a_commit_keeps_each_shards_dead_letters_and_last_error(sqlite_url: str) -> None:
    """Shards share a doc object where they have the same dead-letter count and error (the store encodes
    each object once); shards that differ in either keep their own."""
    with logstore.open(sqlite_url, shards=8) as store, started(store, "app.docs") as coordinator:
        claims = coordinator.claim_many([(shard, lambda: 0) for shard in range(8)])
        boom = {"added_id": 4, "stage": "decode", "error": "CorruptCellError: bad body"}
        other = {"added_id": 9, "stage": "publish", "error": "PublishError: too large"}
        offsets = {0: Offset(5, 0, None), 1: Offset(6, 0, None), 2: Offset(7, 1, boom), 3: Offset(8, 1, boom),
                   4: Offset(9, 1, other), 5: Offset(3, 2, None), 6: Offset(4, 1, None)}
        results = coordinator.commit({shard: (claims[shard], offset) for shard, offset in offsets.items()})
        assert {shard: result.deadlettered for shard, result in results.items()} == {
            shard: offset.deadlettered for shard, offset in offsets.items()}
        stored = store.read_offsets("app.docs")
        assert {shard: (record.location, record.doc) for shard, record in stored.items() if shard in offsets} == {
            shard: (offset.location, {"deadlettered": offset.deadlettered, "last_error": offset.last_error})
            for shard, offset in offsets.items()}
        assert stored[7].location is None

        with started(store, "app.docs") as again:  # a restart resumes from them
            resumed = again.claim_many([(shard, lambda: 0) for shard in range(8)])
        assert [(claim.location, claim.deadlettered) for claim in resumed] == [
            (5, 0), (6, 0), (7, 1), (8, 1), (9, 1), (3, 2), (4, 1), (0, 0)]
