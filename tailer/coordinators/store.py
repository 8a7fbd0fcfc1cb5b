"""Offsets kept in the logstore itself: one process owns every shard, no other server.

This is the embedded default for stream-processing apps (and usable by a standalone
tailer): positions live in the store's consumer-offsets table, on the storage node
holding each shard. Starting claims every shard for this process; a second process started
with the same consumer name takes the shards over, and from then on the first one's
commits are refused (FencedError) and it drops those shards instead of moving the
offsets back. Until its next commit the first one may still deliver cells the second
also delivers: at least once, never skipped. A shard moved to another storage node is not lost: the move
carries its offsets there, and its commits, refused while it moves, go on there after the switch.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from logstore import LogstoreError, OffsetRecord, Store
from tailer.errors import CoordinationError, FencedError
from tailer.interfaces import Claim, Coordinator, Offset

logger = logging.getLogger(__name__)


class StoreCoordinator(Coordinator):
    """Every shard belongs to this process; offsets of ``consumer`` live in ``store``."""

    def __init__(self, store: Store, consumer: str) -> None:
        self.store = store
        self.consumer = consumer
        self.worker_id = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        # (location or None, dead letters) per shard: plain ints, which the garbage collector does not track
        # (4096 records with their docs made each full collection of an app process measurably slower).
        self._records: dict[int, tuple[int | None, int]] = {}
        self._lost: set[int] = set()
        # Built once per change, not per call: the worker asks every iteration and compares by identity.
        self._assigned: frozenset[int] = frozenset(range(store.shard_count))
        self._lock = threading.Lock()
        self._running = False
        self._on_change: Callable[[], None] = lambda: None

    def start(self, on_change: Callable[[], None]) -> None:
        if self._running:
            return
        try:
            self._records = {shard: _position(record)
                             for shard, record in self.store.claim_offsets(self.consumer, self.worker_id).items()}
        except LogstoreError as exc:
            raise CoordinationError(f"cannot claim the offsets of {self.consumer}: {exc}") from exc
        self._on_change = on_change
        self._running = True
        on_change()

    def stop(self) -> None:
        self._running = False

    def assignment(self) -> tuple[int, int, frozenset[int]]:
        if not self._running:
            return 1, 1, frozenset()
        with self._lock:
            return 1, 1, self._assigned

    @property
    def lost(self) -> frozenset[int]:
        """Shards another process has taken over since this one started."""
        with self._lock:
            return frozenset(self._lost)

    def lease_valid(self) -> bool:
        return self._running

    def is_leader(self) -> bool:
        return True

    def claim(self, shard: int, initial: Callable[[], int]) -> Claim | None:
        location, deadlettered = self._records.get(shard, (None, 0))
        return Claim(shard, initial() if location is None else location, 0, self.worker_id, deadlettered)

    def commit(self, offsets: Mapping[int, tuple[Claim, Offset]]) -> dict[int, Claim | BaseException]:
        # One doc object per distinct (dead letters, last error): the store encodes each object once.
        shared: dict[tuple[int, int], dict[str, Any]] = {}
        docs: dict[int, tuple[int, dict[str, Any]]] = {}
        for shard, (_claim, offset) in offsets.items():
            key = (offset.deadlettered, id(offset.last_error))  # the error is alive: held by ``offsets``
            doc = shared.get(key)
            if doc is None:
                doc = shared[key] = {"deadlettered": offset.deadlettered, "last_error": offset.last_error}
            docs[shard] = (offset.location, doc)
        try:
            fenced = self.store.commit_offsets(self.consumer, self.worker_id, docs)
        except LogstoreError as exc:
            error = CoordinationError(f"offsets of {self.consumer} not committed: {exc}")
            return dict.fromkeys(offsets, error)
        moving = self._moving(fenced) if fenced else set()
        if moving:
            logger.info("%s: %d shards are being moved to another storage node: their commits wait for the move",
                        self.consumer, len(moving))
        fenced -= moving
        if fenced:
            logger.error("%s: %d shards were taken over by another process", self.consumer, len(fenced))
            with self._lock:
                self._lost |= fenced
                self._assigned = self._assigned - fenced
            self._on_change()
        deferred = CoordinationError(f"offsets of {self.consumer} not committed: the shard is being moved")
        return {shard: deferred if shard in moving
                else FencedError(shard, "another process took the shard over; its commit was refused")
                if shard in fenced else claim if claim.deadlettered == offset.deadlettered
                else claim._replace(deadlettered=offset.deadlettered)  # a new claim only when it changed
                for shard, (claim, offset) in offsets.items()}

    def _moving(self, refused: set[int]) -> set[int]:
        """The refused shards a move took rather than another process: the record where the shard map now puts
        them still names this worker (a move carries it to the target, where the next commit goes once the map
        shows the switch). Their commits are retried; an unreadable answer counts as moving, to be asked again."""
        try:
            self.store.refresh_map()
            records = self.store.read_offsets(self.consumer)
        except LogstoreError as exc:
            logger.warning("%s: cannot tell whether %d refused shards moved: %s", self.consumer, len(refused), exc)
            return set(refused)
        return {shard for shard in refused if (record := records.get(shard)) is not None
                and record.owner == self.worker_id}

    def release(self, claim: Claim) -> None:
        """Nothing to hand over: the next process claims every shard when it starts."""

    def release_many(self, claims: Sequence[Claim]) -> None:
        """Nothing to hand over (no call per shard of the thousands a stopping worker releases)."""


def _position(record: OffsetRecord) -> tuple[int | None, int]:
    return record.location, int(record.doc.get("deadlettered", 0))
