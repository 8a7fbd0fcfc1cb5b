"""A standby mirror: instance B kept a copy of instance A with the same added_ids (``cellstream mirror run --from
A --to B``). MirrorMaker 2 without its offset translation: an id on B names the cell it names on A, so a
consumer pointed at B goes on from the offset it had on A.

The mirror's position in each shard is B's head. B holds exactly A's log up to it: cells are copied in id
order, each batch of a node at once, and :meth:`~logstore.persistence.NodeRecorder.restore_cells` refuses an
id that is not above the head, so a mirror killed at any point resumes from B itself, never copying a cell
twice or skipping one. The shards to read are those whose count moved on A since the last pass (a complete
count now and then, as the tailer takes). A cell A cannot decode stops its shard's copy there, reported
(``stalled``), never skipped. Consumer offsets kept in A are copied too, each lowered to its shard's copied
head (a consumer on B never starts past what B holds).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from logstore.cell import PackedCell, compress
from logstore.errors import ConfigurationError, CorruptCellError, InvalidArgumentError, StorageUnavailableError
from logstore.persistence import RestoredCell, TruncatedPage
from logstore.store import Store

logger = logging.getLogger(__name__)
COMPLETE_EVERY = 0.5  # seconds between complete counts of A (a partial one may miss a slow transaction)
OFFSETS_EVERY = 5.0  # seconds between copies of the consumers' offsets


class MirrorPass(NamedTuple):
    """What one pass of the copy did."""

    copied: int  # cells written to B
    shards: int  # shards that had cells to copy
    stalled: dict[int, str]  # shard -> why its copy stopped (a cell A cannot decode)


class MirrorLag(NamedTuple):
    """How far B is behind A, as ``cellstream mirror status`` shows it."""

    shards_behind: int
    cells: int  # cells A holds that B does not
    seconds: float  # age of the oldest cell A holds that B does not (0: caught up)
    behind: dict[int, tuple[int, int]]  # up to 20 shards behind: shard -> (A's head, B's head)


class Mirror:
    """Copies A's logs into B (see the module docstring); one thread calls :meth:`copy` (or :meth:`run`)."""

    def __init__(self, source: Store, target: Store, *, page_size: int = 1000, level: int = 6,
                 clock: Callable[[], float] = time.monotonic, source_name: str = "another instance") -> None:
        """Marks every node of B a mirror (``mirror_of``: B's stores refuse writes until :func:`promote_mirror`).

        Args:
            source: A.
            target: B, with A's shard count, empty or a mirror of A (its heads no further than A's).
            page_size: cells read from a shard at once.
            level: zlib level of the bodies written to B.
            source_name: how B's refusals name A (its URL without a password).

        Raises:
            ConfigurationError: the shard counts differ, or B holds a shard further than A does.
        """
        if source.shard_count != target.shard_count:
            raise ConfigurationError(f"a mirror keeps the same added_ids, so the same shard count: the source has "
                                     f"{source.shard_count} shards, the target {target.shard_count}")
        self._source, self._target = source, target
        self._page, self._level, self._clock = page_size, level, clock
        self._heads = target.heads()  # B's heads: the copy's position in each shard
        source_heads = source.heads()
        if ahead := [s for s, h in self._heads.items() if h > source_heads.get(s, 0)]:
            raise ConfigurationError(f"the target holds shard {ahead[0]} up to added_id {self._heads[ahead[0]]}, "
                                     f"further than the source ({source_heads.get(ahead[0], 0)}): it is not a "
                                     "mirror of this source")
        for node in target.nodes:
            recorder = target.node_recorder(node)
            if recorder is not None:
                recorder.write_marker("mirror_of", source_name)
        self._counts: dict[int, int] = {}
        self._mark: object | None = None
        self._complete_at = float("-inf")
        self._offsets_at = float("-inf")
        self.copied = 0  # cells written to B since this mirror started

    @property
    def heads(self) -> dict[int, int]:
        """B's head of each shard, as this mirror last wrote or read it."""
        return dict(self._heads)

    def _moved(self) -> list[int]:
        """The shards whose count moved on A since the last pass (every shard with cells at the first)."""
        now = self._clock()
        complete = now - self._complete_at >= COMPLETE_EVERY
        answer = self._source.changed_counts(None if complete else self._mark)
        if answer.complete:
            self._complete_at = now
        self._mark = answer.mark
        moved = [s for s, n in answer.counts.items() if n != self._counts.get(s, 0)]
        self._counts.update(answer.counts)
        return sorted(moved)

    def copy(self) -> MirrorPass:
        """One pass: every cell A holds past B's heads in the shards that moved, until each is copied whole or
        stalls on a cell A cannot decode.

        Raises:
            StorageUnavailableError: a node of A or B does not answer (retriable: call again).
            StorageError: B refuses a cell (it was written there by another writer: not a mirror).
        """
        copied, busy, stalled = 0, 0, dict[int, str]()
        todo = self._moved()
        busy = len(todo)
        while todo:
            pages = self._source.read_pages({s: self._heads[s] for s in todo}, self._page, packed=True).decode()
            batches: dict[str, list[RestoredCell]] = {}
            more: list[int] = []
            for shard, page in pages.items():
                cells: list[PackedCell]
                if isinstance(page, CorruptCellError):
                    cells = list(page.cells_before)
                    stalled[shard] = str(page)
                else:
                    cells = [c for c in page if isinstance(c, PackedCell)]
                    if isinstance(page, TruncatedPage) or len(cells) >= self._page:
                        more.append(shard)
                if cells:
                    batches.setdefault(self._target.node_of(shard), []).extend(
                        RestoredCell(c.shard, c.added_id, c.row_key, c.column, c.ref_key,
                                     compress(c.packed, self._level), c.created_at) for c in cells)
            for node, batch in batches.items():
                recorder = self._target.node_recorder(node)
                if recorder is None:
                    raise ConfigurationError(f"storage node {node} of the target is not open here")
                recorder.restore_cells(batch)
                for cell in batch:
                    self._heads[cell.shard] = cell.added_id
                copied += len(batch)
            todo = more
        for shard, why in stalled.items():
            logger.error("mirror: shard %d stops at added_id %d: %s", shard, self._heads[shard], why)
        self.copied += copied
        if self._clock() - self._offsets_at >= OFFSETS_EVERY:
            self.copy_offsets()
        return MirrorPass(copied, busy, stalled)

    def copy_offsets(self) -> int:
        """Copy every consumer's offsets kept in A to B, each lowered to its shard's head on B. Returns the
        consumers copied."""
        self._offsets_at = self._clock()
        self._source.check_direct("a mirror")
        names = self._source.consumers()
        for consumer in names:
            by_owner: dict[str, dict[int, tuple[int, dict[str, Any]]]] = {}
            for shard, record in self._source.read_offsets(consumer).items():
                if record.location is None:
                    continue
                location = min(record.location, self._heads.get(shard, 0))
                by_owner.setdefault(record.owner, {})[shard] = (location, dict(record.doc))
            for owner, offsets in sorted(by_owner.items()):
                self._target.claim_offsets(consumer, owner, sorted(offsets))
                self._target.commit_offsets(consumer, owner, offsets)
        return len(names)

    def run(self, stop: threading.Event, *, interval: float = 0.05,
            on_pass: Callable[[MirrorPass], None] | None = None) -> None:
        """Copy until ``stop`` is set: a pass, then a pause of ``interval`` when it found nothing to copy.
        A node that does not answer is waited for (logged), not a reason to stop."""
        while not stop.is_set():
            try:
                done = self.copy()
            except StorageUnavailableError as exc:
                logger.warning("mirror: waiting for a node: %s", exc)
                stop.wait(1.0)
                continue
            if on_pass is not None:
                on_pass(done)
            if not done.copied:
                stop.wait(interval)


class Promoted(NamedTuple):
    """What ``cellstream mirror promote`` did."""

    was_mirror_of: str
    burnt_shards: int
    burn: int


def promote_mirror(target: Store, *, burn: int = 1_000_000) -> Promoted:
    """Make a standby mirror writable (a site switchover): each shard's next id skips ``burn`` ids (cells its
    source gave ids after the mirror's last copy may have reached consumers, and those ids must never name
    another cell), then the ``mirror_of`` marks go. Stop the mirror first: it would refuse to go on.

    Raises:
        InvalidArgumentError: the store is not a mirror; a negative ``burn``.
        ConfigurationError: a node that cannot skip ids (SQLite numbers cells per node, not per shard: only
            ``burn=0``, accepting that ids the source gave since the last copy name other cells here).
    """
    source = target.mirror_of()
    if source is None:
        raise InvalidArgumentError("this store is not a standby mirror (`cellstream mirror run` marks one)")
    if burn < 0:
        raise InvalidArgumentError(f"burn must be 0 or more ids, got {burn}")
    burnt = 0
    for node in target.nodes:
        recorder = target.node_recorder(node)
        if recorder is not None and burn:
            burnt += recorder.burn_ids(burn)
    for node in target.nodes:
        recorder = target.node_recorder(node)
        if recorder is not None:
            recorder.write_marker("mirror_of", None)
    logger.warning("the standby mirror of %s is writable now; %d shards' next ids skip %d ids", source, burnt, burn)
    return Promoted(source, burnt, burn)


def mirror_lag(source: Store, target: Store, *, now: dt.datetime | None = None) -> MirrorLag:
    """How far ``target`` is behind ``source`` (``cellstream mirror status``).

    Raises:
        InvalidArgumentError: the shard counts differ.
    """
    if source.shard_count != target.shard_count:
        raise InvalidArgumentError(f"the source has {source.shard_count} shards, the target {target.shard_count}: "
                                   "not a mirror")
    theirs, ours = source.heads(), target.heads()
    behind = {s: ours.get(s, 0) for s, h in theirs.items() if h > ours.get(s, 0)}
    if not behind:
        return MirrorLag(0, 0, 0.0, {})
    cells = sum(source.counts_after(behind).values())
    firsts = source.get_cells_for_shards(behind, 1)
    oldest = min((page[0].created_at for page in firsts.values() if isinstance(page, list) and page),
                 default=None)
    at = now or dt.datetime.now(dt.UTC)
    seconds = max(0.0, (at - oldest).total_seconds()) if oldest is not None else 0.0
    shown = dict(sorted(behind.items())[:20])
    return MirrorLag(len(behind), cells, seconds, {s: (theirs[s], b) for s, b in shown.items()})



class MirrorMetrics:
    """The mirror's Prometheus series (``cellstream mirror run --metrics-port``):

    - ``cellstream_mirror_copied_cells_total``: cells written to the target;
    - ``cellstream_mirror_lag_cells``, ``cellstream_mirror_lag_seconds``: :class:`MirrorLag`'s, read at most
      once a second (a read of both stores);
    - ``cellstream_mirror_stalled_shards``: shards whose copy stopped on a cell the source cannot decode.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.copied = Counter("cellstream_mirror_copied_cells", "Cells the mirror wrote to its target",
                              registry=self.registry)
        self.lag_cells = Gauge("cellstream_mirror_lag_cells", "Cells the source holds that the mirror does not",
                               registry=self.registry)
        self.lag_seconds = Gauge("cellstream_mirror_lag_seconds", "Age of the oldest cell the mirror has not "
                                 "copied (0: caught up)", registry=self.registry)
        self.stalled = Gauge("cellstream_mirror_stalled_shards", "Shards whose copy stopped on a cell the source "
                             "cannot decode", registry=self.registry)

    def passed(self, done: MirrorPass) -> None:
        self.copied.inc(done.copied)
        self.stalled.set(len(done.stalled))

    def lagged(self, lag: MirrorLag) -> None:
        self.lag_cells.set(lag.cells)
        self.lag_seconds.set(lag.seconds)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)
