"""The read scheduler of a tailer worker: which owned shards to read next, and when to poll their counts.

Each owned shard waits for one thing at a time, and :meth:`ReadScheduler.requeue` files it by that: a
read (ready, or delayed while it backs off), the count poll that sizes its first read (uncounted), a
count poll that finds new cells (idle: drained, nothing in flight; acking: drained, its last cells still
being acknowledged), or what is under way (live, in no queue: the end of its read or delivery requeues
it). The scheduler decides and the worker (:mod:`tailer.worker`) does the reading and the delivering, so
an iteration of the worker's loop costs what the shards with cells under way cost, not what the owned
shards do (4096 by default). See docs/tailer.md for the design.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping

from logstore import ChangedCounts
from tailer.config import TailerConfig
from tailer.polling import PollSchedule
from tailer.shardstate import Drained, Pages, ShardState

# A count poll costs in proportion to the shards it counts, so polls are spaced to take at most this share
# of the worker's time; where counting is cheap the poll interval decides. With every shard idle the polls
# are all there is to do (their spacing is a new cell's latency); with a backlog the worker has known work.
_POLL_SHARE_IDLE = 0.5
_POLL_SHARE = 0.25
_POLL_SHARE_BACKLOG = 0.02
# A poll's cost is the least of the recent polls': one that waited for a core or a busy database is not
# what counting costs, and spacing the next poll by it delays every cell written meanwhile.
_POLL_COSTS = 16
# Every shard's count this often: a partial count (the shards that moved since the last poll) can miss a
# writer that committed late (Store.changed_counts), and only a complete one proves the shards caught up.
_FULL_POLL = 0.5

# A read to launch: the shards' positions to read after, and the page size.
ReadRequest = tuple[dict[int, int], int]
# What a count poll hands its thread: (also read the shards being acknowledged, the mark to count since).
PollRequest = tuple[bool, object | None]


class ReadScheduler:
    """The queues of a worker's owned shards and the pacing of its count polls.

    Runs on the worker's event loop, except :meth:`moved` (a count poll's thread). Knows no store and
    no sink: it reads and updates the :class:`~tailer.shardstate.ShardState` the worker hands it.
    """

    def __init__(self, config: TailerConfig, read_ahead: int) -> None:
        """Args:
            config: the worker's configuration (page size, in-flight limit, poll intervals).
            read_ahead: how many reads may run at once.
        """
        self._config = config
        self._read_ahead = read_ahead
        self.counts: dict[int, int] = {}  # cells per shard, as the count polls found them
        self.live: set[int] = set()  # owned and not idle: a read or delivery under way, or due
        # Read by a count poll's thread too (a dict's get and copy hold the GIL): never rebound.
        self._idle: dict[int, Drained] = {}
        self._acking: dict[int, Drained] = {}
        self._uncounted: set[int] = set()
        # Round-robin; an OrderedDict because a plain dict's first key after deletions walks their slots.
        self._ready: OrderedDict[int, None] = OrderedDict()
        self._delayed: list[tuple[float, int]] = []  # heap of (retry_at, shard)
        self._touched: set[int] = set()  # whose reads or deliveries moved since they were last requeued
        self._stopping = False
        self._polls = PollSchedule(config.poll_interval, config.idle_poll_interval)
        self._polled_at = -1e9
        self._poll_spacing = config.poll_interval  # from one poll's start to the next's
        self._mark: object | None = None  # the last poll's, to count since (Store.changed_counts)
        self._full_at = -1e9  # when the last poll that counted every shard started
        self._poll_cost = 0.0
        self._poll_costs: deque[float] = deque(maxlen=_POLL_COSTS)
        self._poll_soon = False  # a caller waits for a poll to prove the shards caught up: not spaced
        self.polling = False
        self.quiet_at = -1e9  # when the last poll that found every owned shard caught up started

    # -- the queues -----------------------------------------------------------
    def requeue(self, st: ShardState, now: float) -> None:
        """File a shard by what it waits for (see the module's docstring)."""
        shard = st.shard
        self._ready.pop(shard, None)
        self._acking.pop(shard, None)
        if st.reading is None and st.drained and not st.inflight and st.retry_at <= now:
            self.live.discard(shard)
            self._idle[shard] = (st.count_seen, st.position)
            return
        self._idle.pop(shard, None)
        self.live.add(shard)
        if st.reading is not None or self._stopping:
            return
        if st.retry_at > now:
            heapq.heappush(self._delayed, (st.retry_at, shard))
        elif st.drained:
            if st.acked >= st.singles_until:  # not isolating a refused cell: a poll reads its next cells meanwhile
                self._acking[shard] = (st.count_seen, st.position)
        elif st.count_seen is None and shard not in self.counts:
            self._uncounted.add(shard)
        else:
            self._ready[shard] = None

    def touch(self, shards: Iterable[int]) -> None:
        """Note shards whose read or delivery moved: they are requeued before the next reads."""
        self._touched.update(shards)

    def rewound(self, shard: int) -> None:
        """The shard's position went back to its last acknowledged cell: it is no longer drained there."""
        self._acking.pop(shard, None)

    def forget(self, shard: int) -> None:
        """Drop a shard that is no longer owned."""
        self.live.discard(shard)
        self._idle.pop(shard, None)
        self._acking.pop(shard, None)
        self._ready.pop(shard, None)
        self._uncounted.discard(shard)

    def stop(self) -> None:
        """No shard is queued for a read from now on."""
        self._stopping = True

    def clear(self) -> None:
        """Forget every shard."""
        for held in (self.live, self._idle, self._acking, self._ready, self._uncounted):
            held.clear()

    # -- reads ----------------------------------------------------------------
    def next_reads(self, shards: Mapping[int, ShardState], now: float, running: int, in_flight: int
                   ) -> list[ReadRequest]:
        """The reads to launch now, in order.

        A shard reserves a page (at its first read, no more than its cell count), and shards are grouped
        until a read reserves about a page: a busy shard is read alone, many small ones together. At most
        ``read_ahead`` reads run at once, within ``max_in_flight`` messages. Idle shards are left to the
        count polls.

        Args:
            shards: the owned shards.
            now: the worker's clock.
            running: reads launched and not finished.
            in_flight: messages delivered and not settled, and cells reserved by running reads.

        Returns:
            (positions, page size) of each read; each shard's ``read_reserved`` is set.
        """
        touched, self._touched = self._touched, set()
        for shard in touched:
            if (st := shards.get(shard)) is not None:
                self.requeue(st, now)
        while self._delayed and self._delayed[0][0] <= now:
            if (st := shards.get(heapq.heappop(self._delayed)[1])) is not None:
                self.requeue(st, now)
        page_size = self._config.page_size
        reads: list[ReadRequest] = []
        batch: dict[int, int] = {}
        singles: dict[int, int] = {}
        reserved = 0
        while self._ready and running < self._read_ahead and in_flight < self._config.max_in_flight:
            shard, _ = self._ready.popitem(last=False)  # from the front; it queues again at the back after its page
            st = shards[shard]
            expected = self._expected(st, now)
            if expected is None:
                self.requeue(st, now)  # an empty shard goes idle
                continue
            if st.acked < st.singles_until:  # isolating a refused cell: one message at a time
                if not st.inflight:
                    singles[shard] = st.position
                continue  # else its acknowledgements requeue it
            batch[shard] = st.position
            st.read_reserved = min(expected, page_size)
            reserved += st.read_reserved
            in_flight += st.read_reserved
            if reserved >= page_size:
                reads.append((batch, page_size))
                running += 1
                batch, reserved = {}, 0
        if batch:
            reads.append((batch, page_size))
        if singles:
            reads.append((singles, 1))
        return reads

    def _expected(self, st: ShardState, now: float) -> int | None:
        """How many cells a read of the shard may bring (None: not now)."""
        if st.reading is not None or st.drained or st.retry_at > now or self._stopping:
            return None
        if st.count_seen is None:  # its first read, once a count poll has counted the shards
            if st.shard not in self.counts:
                return None
            count = st.count_seen = self.counts[st.shard]
            if count == 0:  # an empty shard: nothing to read until its count moves
                st.drained = True
                return None
            return count
        return self._config.page_size

    @property
    def backlog(self) -> bool:
        """Shards are waiting for a read."""
        return bool(self._ready)

    # -- count polls ----------------------------------------------------------
    def poll_due(self, now: float, unsettled: int) -> bool:
        """Whether a count poll should start now (``unsettled``: messages delivered and not settled)."""
        if self._ready or unsettled >= self._config.page_size:
            share = _POLL_SHARE_BACKLOG
        else:
            share = _POLL_SHARE if self.live else _POLL_SHARE_IDLE
        due = self._poll_spacing = max(self._polls.interval, self._poll_cost / share)
        return (now - self._polled_at >= due or self._poll_soon) and not self.polling

    def start_poll(self, now: float, unsettled: int) -> PollRequest:
        """Note a count poll starting at ``now``; what its thread is to count and read (see :meth:`moved`)."""
        acking = unsettled < self._config.max_in_flight  # a stalled sink must hold reading back, as for busy shards
        full = self._poll_soon or now - self._full_at >= _FULL_POLL
        self._poll_soon = False
        self._polled_at = now
        self.polling = True
        return acking, None if full else self._mark

    def moved(self, answer: ChangedCounts, acking: bool) -> dict[int, Drained]:
        """(in the count poll's thread) The drained shards whose count moved: idle ones, and with ``acking``
        those being acknowledged, each as this thread saw it (compared again by :meth:`polled`)."""
        counts = answer.counts
        if answer.complete:
            drained = {**self._idle, **self._acking} if acking else self._idle.copy()
            return {shard: entry for shard, entry in drained.items() if counts.get(shard) != entry[0]}
        moved: dict[int, Drained] = {}
        for shard, count in counts.items():
            entry = (self._acking.get(shard) if acking else None) or self._idle.get(shard)
            if entry is not None and entry[0] != count:
                moved[shard] = entry
        return moved

    def polled(self, answer: ChangedCounts | None, compared: dict[int, Drained], found: Pages, cost: float,
               started: float, all_idle: bool) -> list[int]:
        """Take a count poll's answer (None: the counting failed) and pages.

        Args:
            answer: the counts, if read.
            compared: the shards :meth:`moved` found, as compared.
            found: the pages read of those shards.
            cost: seconds the counting took.
            started: when the poll started.
            all_idle: every owned shard was idle when it started.

        Returns:
            The shards whose pages are to be delivered: still drained where the poll compared them. Each is
            live from now on, with its new count seen.
        """
        self.polling = False
        self._poll_costs.append(cost)
        self._poll_cost = min(self._poll_costs)
        if answer is not None:
            self._mark = answer.mark
            if answer.complete:
                self.counts, self._full_at = answer.counts, started
                if all_idle and not found:
                    self.quiet_at = started
            else:
                self.counts.update(answer.counts)
            self._touched |= self._uncounted  # their first reads can be sized now (or they wait again)
            self._uncounted = set()
        moved: list[int] = []
        for shard in found:
            seen = compared[shard]
            if seen not in (self._idle.get(shard), self._acking.get(shard)):
                continue  # released, or no longer the drained shard the poll compared (read since, rewound)
            self._idle.pop(shard, None)
            self._acking.pop(shard, None)
            self.live.add(shard)
            moved.append(shard)
        self._polls.polled(started, active=bool(found) or bool(self.live))
        return moved

    def request_poll(self) -> None:
        """The next count poll is due at once, and counts every shard."""
        self._poll_soon = True

    @property
    def poll_requested(self) -> bool:
        return self._poll_soon

    def pause(self, now: float, owned: bool) -> float:
        """How long the worker's loop may sleep with nothing to do: until the next count poll is due.

        Not a whole poll interval from now: acknowledgements wake the loop between polls, and a full
        interval from such a wake-up would space the polls up to twice the interval apart.
        """
        if not owned or self.polling:
            return self._polls.interval  # a poll's end wakes the loop: it must not spin while one runs late
        return min(self._polls.interval, max(0.0, self._polled_at + self._poll_spacing - now))
