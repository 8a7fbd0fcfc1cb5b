"""The read scheduler alone: no store, no sink, no event loop; a shard's state as the worker keeps it."""

from __future__ import annotations

import asyncio

import pytest

from logstore import ChangedCounts
from tailer.config import TailerConfig
from tailer.interfaces import Claim
from tailer.reads import ReadScheduler
from tailer.shardstate import Pending, ShardState


def config(**fields: object) -> TailerConfig:
    return TailerConfig(name="reads", page_size=10, max_in_flight=100, poll_interval=0.005,
                        idle_poll_interval=0.05, **fields)


def owned(*shards: int, at: int = 0) -> dict[int, ShardState]:
    return {s: ShardState(Claim(s, at, 0, "t", 0), at, at, at, 0) for s in shards}


def counted(reads: ReadScheduler, counts: dict[int, int], started: float = 0.0) -> None:
    """A complete count poll that found no page to read."""
    reads.start_poll(started, 0)
    reads.polled(ChangedCounts(counts, ("mark", 1), True), {}, {}, 0.001, started, all_idle=False)


def in_flight(st: ShardState) -> None:
    """A delivery of the shard's last cell, not settled."""
    loop = asyncio.new_event_loop()
    st.inflight.append(Pending(st.position, loop.create_future(), {}, "t", False))
    loop.close()


def drain(st: ShardState, count: int, position: int) -> None:
    st.drained, st.count_seen, st.position, st.acked = True, count, position, position


def test_a_shard_waits_for_a_count_before_its_first_read_and_an_empty_one_goes_idle() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(1, 2)
    for st in shards.values():
        reads.requeue(st, 0.0)
    assert reads.next_reads(shards, 0.0, running=0, in_flight=0) == []  # nothing counted yet
    counted(reads, {1: 3, 2: 0})
    assert reads.next_reads(shards, 0.0, running=0, in_flight=0) == [({1: 0}, 10)]
    assert shards[1].read_reserved == 3  # a first read reserves no more than the shard holds
    assert shards[2].drained and shards[2].count_seen == 0
    assert reads.live == {1}  # shard 2 idle: a count poll reads it once its count moves
    assert reads.moved(ChangedCounts({2: 1}, None, False), acking=False) == {2: (0, 0)}


def test_shards_are_grouped_until_a_read_reserves_a_page_within_read_ahead_and_in_flight() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=2), owned(*range(8))
    counted(reads, dict.fromkeys(range(8), 4))
    for st in shards.values():
        reads.requeue(st, 0.0)
    first = reads.next_reads(shards, 0.0, running=0, in_flight=0)
    # 4 cells each, a page of 10: three shards a read, and two reads at most at once.
    assert [sorted(positions) for positions, _ in first] == [[0, 1, 2], [3, 4, 5]]
    assert reads.next_reads(shards, 0.0, running=2, in_flight=0) == []
    assert [sorted(p) for p, _ in reads.next_reads(shards, 0.0, running=1, in_flight=0)] == [[6, 7]]
    again = ReadScheduler(config(), read_ahead=4)
    counted(again, dict.fromkeys(range(8), 4))
    for st in owned(*range(8)).values():
        again.requeue(st, 0.0)
    assert again.next_reads(owned(*range(8)), 0.0, running=0, in_flight=100) == []  # max_in_flight reached
    assert again.backlog


def test_ready_shards_are_read_round_robin() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=1), owned(1, 2, 3)
    counted(reads, dict.fromkeys(shards, 50))
    for st in shards.values():
        reads.requeue(st, 0.0)
    assert reads.next_reads(shards, 0.0, running=0, in_flight=0) == [({1: 0}, 10)]
    shards[1].count_seen = 50
    reads.requeue(shards[1], 0.0)  # its page was delivered: to the back of the queue
    assert [list(p) for p, _ in reads.next_reads(shards, 0.0, running=0, in_flight=0)] == [[2]]
    assert [list(p) for p, _ in reads.next_reads(shards, 0.0, running=0, in_flight=0)] == [[3]]
    assert [list(p) for p, _ in reads.next_reads(shards, 0.0, running=0, in_flight=0)] == [[1]]


def test_a_backing_off_shard_is_read_when_its_retry_time_comes() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(7)
    counted(reads, {7: 5})
    shards[7].retry_at = 10.0
    reads.requeue(shards[7], 0.0)
    assert reads.next_reads(shards, 9.9, running=0, in_flight=0) == []
    assert reads.next_reads(shards, 10.0, running=0, in_flight=0) == [({7: 0}, 10)]


def test_a_shard_isolating_a_refused_cell_is_read_one_cell_at_a_time_once_nothing_is_in_flight() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(3, at=5)
    counted(reads, {3: 9})
    st = shards[3]
    st.count_seen, st.singles_until = 9, 8
    in_flight(st)
    reads.requeue(st, 0.0)
    assert reads.next_reads(shards, 0.0, running=0, in_flight=0) == []  # its acknowledgement requeues it
    st.inflight.clear()
    reads.requeue(st, 0.0)
    assert reads.next_reads(shards, 0.0, running=0, in_flight=0) == [({3: 5}, 1)]


def test_a_count_poll_reads_the_drained_shards_whose_count_moved() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(1, 2, 3)
    drain(shards[1], 4, 40)  # idle
    drain(shards[2], 6, 60)  # idle, unchanged
    drain(shards[3], 2, 20)  # drained, cells still being acknowledged
    in_flight(shards[3])
    for st in shards.values():
        reads.requeue(st, 0.0)
    assert reads.live == {3}
    complete = ChangedCounts({1: 5, 2: 6, 3: 3}, None, True)
    assert reads.moved(complete, acking=True) == {1: (4, 40), 3: (2, 20)}
    assert reads.moved(complete, acking=False) == {1: (4, 40)}  # a stalled sink holds the reading back
    partial = ChangedCounts({2: 7}, None, False)  # only the shards that may have moved
    assert reads.moved(partial, acking=True) == {2: (6, 60)}


def test_a_count_polls_pages_go_only_to_shards_still_drained_where_it_compared_them() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(1, 2)
    drain(shards[1], 4, 40)
    drain(shards[2], 4, 40)
    for st in shards.values():
        reads.requeue(st, 0.0)
    acking, _mark = reads.start_poll(0.0, 0)
    answer = ChangedCounts({1: 5, 2: 5}, "m", True)
    compared = reads.moved(answer, acking)
    shards[2].drained = False  # read meanwhile by the worker
    reads.requeue(shards[2], 0.0)
    moved = reads.polled(answer, compared, {1: [], 2: []}, 0.001, 0.0, all_idle=True)
    assert moved == [1]
    assert reads.live == {1, 2} and reads.counts == {1: 5, 2: 5}
    assert reads.quiet_at < 0  # it found cells: not a proof that the shards caught up


def test_a_poll_finding_every_shard_idle_and_nothing_new_proves_them_caught_up() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(1)
    drain(shards[1], 4, 40)
    reads.requeue(shards[1], 0.0)
    reads.request_poll()
    assert reads.poll_due(0.0, 0)
    acking, mark = reads.start_poll(3.0, 0)
    assert mark is None  # a requested poll counts every shard
    answer = ChangedCounts({1: 4}, "m", True)
    assert reads.polled(answer, reads.moved(answer, acking), {}, 0.001, 3.0, all_idle=True) == []
    assert reads.quiet_at == 3.0


@pytest.mark.parametrize(("cost", "live", "spacing", "pause"), [
    (0.0001, False, 0.01, 0.01),  # cheap: the poll interval, doubled after a poll of idle shards found nothing
    (0.01, False, 0.02, 0.01),  # with every shard idle, half of the time at most
    (0.01, True, 0.04, 0.005),  # with cells under way, a quarter; the interval stays the fastest
])
def test_count_polls_are_spaced_to_take_a_share_of_the_time(cost: float, live: bool, spacing: float,
                                                            pause: float) -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(1)
    drain(shards[1], 4, 40)
    if live:  # being read
        loop = asyncio.new_event_loop()
        shards[1].reading = loop.create_future()
        loop.close()
    reads.requeue(shards[1], 0.0)
    reads.start_poll(0.0, 0)
    reads.polled(ChangedCounts({1: 4}, "m", False), {}, {}, cost, 0.0, all_idle=False)
    assert not reads.poll_due(spacing - 1e-4, 0)
    assert reads.poll_due(spacing + 1e-4, 0)
    assert reads.pause(0.0, owned=True) == pytest.approx(pause)


def test_no_second_poll_while_one_runs_and_a_partial_one_counts_since_the_last_mark() -> None:
    reads = ReadScheduler(config(), read_ahead=4)
    _acking, mark = reads.start_poll(0.0, 0)
    assert mark is None and reads.polling and not reads.poll_due(1.0, 0)
    reads.polled(ChangedCounts({}, ("m", 2), True), {}, {}, 0.0001, 0.0, all_idle=False)
    assert reads.start_poll(0.1, 0) == (True, ("m", 2))
    assert reads.start_poll(0.1, 10**6)[0] is False  # at max_in_flight: no acking shard is read


def test_one_slow_poll_does_not_space_out_the_next() -> None:
    reads, shards = ReadScheduler(config(), read_ahead=4), owned(1)
    loop = asyncio.new_event_loop()
    shards[1].reading = loop.create_future()  # live: the fastest interval, a quarter of the time
    loop.close()
    reads.requeue(shards[1], 0.0)
    for cost in (0.002, 0.05):  # the second waited for a core: not what counting costs
        reads.start_poll(0.0, 0)
        reads.polled(ChangedCounts({}, "m", False), {}, {}, cost, 0.0, all_idle=False)
    assert not reads.poll_due(0.0079, 0)
    assert reads.poll_due(0.0081, 0)
