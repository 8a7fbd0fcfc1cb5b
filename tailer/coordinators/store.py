"""Offsets kept in the logstore itself: one process owns every shard, no other server.

This is the embedded default for stream-processing apps (and usable by a standalone
tailer): positions live in the store's consumer-offsets table, on the storage node
holding each shard. Starting claims every shard for this process; a second process started
with the same consumer name takes the shards over, and from then on the first one's
commits are refused (FencedError) and it drops those shards instead of moving the
offsets back. Until its next commit the first one may still deliver cells the second
also delivers: at least once, never skipped. A shard moved to another storage node is not lost: the move
carries its offsets there, and its commits, refused while it moves, go on there after the switch.

An offsets reset (``cellstream offsets reset``, :mod:`tailer.offsets.store`) takes shards over the same way,
under an owner of its own; this coordinator, finding such an owner (at a refused commit, or by looking every
``reset_check`` seconds while idle), claims the shards back at the reset's positions and has the worker drop
and claim them again. Each adoption bumps the shard's epoch (the claims' ``version``), so a commit of a
position from before it is refused instead of moving the shard back.
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
from logstore.offsets import is_reset_owner
from tailer.errors import CoordinationError, FencedError
from tailer.interfaces import Claim, Coordinator, Offset

logger = logging.getLogger(__name__)


class StoreCoordinator(Coordinator):
    """Every shard belongs to this process; offsets of ``consumer`` live in ``store``."""

    def __init__(self, store: Store, consumer: str, *, columns: Sequence[str] | None = None,
                 reset_check: float = 2.0) -> None:
        """Args:
            store: where the offsets live.
            consumer: their name (an app's is ``app.NAME``).
            columns: the columns the consumer reads, kept with its offsets (``cellstream offsets`` counts its
                lag in them); None: every column.
            reset_check: seconds between two looks for an offsets reset while the worker commits nothing.
        """
        self.store = store
        self.consumer = consumer
        self.columns = sorted(columns) if columns is not None else None
        self.reset_check = reset_check
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
        self._epochs: dict[int, int] = {}  # per shard, bumped by each reset adopted: fences older commits
        self._returning: frozenset[int] = frozenset()  # reset shards the worker drops, then gets back
        self._handed_out = False  # whether the worker has been given the assignment without them
        self._stopped = threading.Event()
        self._checker: threading.Thread | None = None

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
        self._stopped.clear()
        if self.reset_check > 0:
            self._checker = threading.Thread(target=self._check_resets, name=f"{self.consumer}.resets", daemon=True)
            self._checker.start()
        on_change()

    def stop(self) -> None:
        self._running = False
        self._stopped.set()
        if self._checker is not None:
            self._checker.join(timeout=10)
            self._checker = None

    def assignment(self) -> tuple[int, int, frozenset[int]]:
        if not self._running:
            return 1, 1, frozenset()
        with self._lock:
            if self._returning:
                if self._handed_out:  # the worker has dropped them: give them back, to be claimed afresh
                    self._assigned, self._returning = self._assigned | self._returning, frozenset()
                    self._handed_out = False
                else:
                    self._handed_out = True
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
        return Claim(shard, initial() if location is None else location, self._epochs.get(shard, 0), self.worker_id,
                     deadlettered)

    def commit(self, offsets: Mapping[int, tuple[Claim, Offset]]) -> dict[int, Claim | BaseException]:
        # One doc object per distinct (dead letters, last error): the store encodes each object once.
        shared: dict[tuple[int, int], dict[str, Any]] = {}
        docs: dict[int, tuple[int, dict[str, Any]]] = {}
        stale = {shard for shard, (claim, _offset) in offsets.items()
                 if claim.version != self._epochs.get(shard, 0)} if self._epochs else set()
        for shard, (_claim, offset) in offsets.items():
            if shard in stale:
                continue
            key = (offset.deadlettered, id(offset.last_error))  # the error is alive: held by ``offsets``
            doc = shared.get(key)
            if doc is None:
                doc = shared[key] = {"deadlettered": offset.deadlettered, "last_error": offset.last_error}
                if self.columns is not None:
                    doc["columns"] = self.columns
            docs[shard] = (offset.location, doc)
        try:
            fenced = self.store.commit_offsets(self.consumer, self.worker_id, docs)
        except LogstoreError as exc:
            error = CoordinationError(f"offsets of {self.consumer} not committed: {exc}")
            return dict.fromkeys(offsets, error)
        moving, reset = self._moving(fenced) if fenced else (set(), set())
        if reset:
            self._adopt_resets(reset)
        if moving:
            logger.info("%s: %d shards are being moved to another storage node: their commits wait for the move",
                        self.consumer, len(moving))
        fenced -= moving | reset
        if fenced:
            logger.error("%s: %d shards were taken over by another process", self.consumer, len(fenced))
            with self._lock:
                self._lost |= fenced
                self._assigned = self._assigned - fenced
            self._on_change()
        for shard, (_claim, offset) in offsets.items():
            if shard not in fenced and shard not in moving and shard not in stale and shard not in reset:
                self._records[shard] = (offset.location, offset.deadlettered)  # where a claim again resumes
        deferred = CoordinationError(f"offsets of {self.consumer} not committed: the shard is being moved")
        return {shard: deferred if shard in moving
                else FencedError(shard, "an offsets reset moved the shard; it is claimed again at its new position")
                if shard in reset or shard in stale
                else FencedError(shard, "another process took the shard over; its commit was refused")
                if shard in fenced else claim if claim.deadlettered == offset.deadlettered
                else claim._replace(deadlettered=offset.deadlettered)  # a new claim only when it changed
                for shard, (claim, offset) in offsets.items()}

    def _moving(self, refused: set[int]) -> tuple[set[int], set[int]]:
        """Of the refused shards, (those a move took, those an offsets reset took) rather than another process.
        A moved shard's record where the shard map now puts it still names this worker (a move carries it to the
        target, where the next commit goes once the map shows the switch): its commits are retried. An
        unreadable answer counts as moving, to be asked again."""
        try:
            self.store.refresh_map()
            records = self.store.read_offsets(self.consumer)
        except LogstoreError as exc:
            logger.warning("%s: cannot tell whether %d refused shards moved: %s", self.consumer, len(refused), exc)
            return set(refused), set()
        moving = {shard for shard in refused if (record := records.get(shard)) is not None
                  and record.owner == self.worker_id}
        reset = {shard for shard in refused if (record := records.get(shard)) is not None
                 and is_reset_owner(record.owner)}
        return moving, reset

    def _adopt_resets(self, shards: set[int]) -> None:
        """Claim back the shards a reset took, at its positions; later commits of older positions are stale."""
        records = self.store.claim_offsets(self.consumer, self.worker_id, sorted(shards))
        with self._lock:
            for shard, record in records.items():
                self._records[shard] = _position(record)
                self._epochs[shard] = self._epochs.get(shard, 0) + 1
        logger.warning("%s: an offsets reset moved %d shards (e.g. shard %d to %s): going on from there",
                       self.consumer, len(records), min(records), records[min(records)].location)

    def _check_resets(self) -> None:
        """(a thread) Look for a reset now and then: an idle worker commits nothing that would meet its fence."""
        while not self._stopped.wait(self.reset_check):
            try:
                records = self.store.read_offsets(self.consumer)
                reset = {shard for shard, record in records.items() if is_reset_owner(record.owner)
                         and shard in self._assigned}
                if not reset:
                    continue
                self._adopt_resets(reset)
            except Exception as exc:  # a thread of its own: nothing above it would see the error
                if not self._stopped.is_set():
                    logger.warning("%s: cannot look for an offsets reset: %s", self.consumer, exc)
                continue
            with self._lock:  # the worker drops them at its next look, then claims them afresh
                self._assigned = self._assigned - reset
                self._returning = self._returning | reset
                self._handed_out = False
            self._on_change()

    def release(self, claim: Claim) -> None:
        """Nothing to hand over: the next process claims every shard when it starts."""

    def release_many(self, claims: Sequence[Claim]) -> None:
        """Nothing to hand over (no call per shard of the thousands a stopping worker releases)."""


def _position(record: OffsetRecord) -> tuple[int | None, int]:
    return record.location, int(record.doc.get("deadlettered", 0))
