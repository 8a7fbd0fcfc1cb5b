"""The worker's poll schedule: fast while cells arrive, backing off only once they have stopped."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

import logstore
from logstore.backends.mysql.recorder import TOUCH_MARGIN
from tailer.polling import PollSchedule
from tests.contracts.logstore_contract import store_recorders
from tests.tailer.test_shards import held_tailer, until


def test_a_poll_that_finds_nothing_right_after_cells_keeps_the_fast_interval() -> None:
    """At 250 writes a second a quarter of the 5 ms windows are empty: those polls must not slow the
    next one down (backing off at once had doubled the latency of such a stream)."""
    polls = PollSchedule(0.005, 0.05)
    now = 0.0
    for found in [True, False, True, False, False, True, False, False, False] * 20:
        now += polls.interval
        assert polls.polled(now, active=found) == 0.005


def test_quiet_for_the_longest_wait_backs_off_by_doubling_up_to_it_and_cells_reset_it() -> None:
    polls = PollSchedule(0.25, 4.0)  # binary fractions: the sums of the waits are exact
    assert polls.polled(0.0, active=True) == 0.25
    waits, now = [], 0.0
    for _ in range(20):
        now += polls.interval
        waits.append(polls.polled(now, active=False))
    # Fast until 4 s of quiet, then doubling: 0.5, 1, 2, and 4 from there on.
    assert waits == [0.25] * 15 + [0.5, 1.0, 2.0, 4.0, 4.0]
    assert polls.polled(now + 4.0, active=True) == 0.25


def test_a_worker_that_never_saw_a_cell_backs_off_from_its_first_poll() -> None:
    polls = PollSchedule(0.005, 0.05)
    assert [polls.polled(t, active=False) for t in (0.0, 0.01, 0.03)] == [0.01, 0.02, 0.04]


def test_an_acknowledgement_between_polls_does_not_push_the_next_poll_back(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acknowledgements wake the loop between polls. The next poll stays one interval after the start of
    the last one: sleeping a whole interval from each such wake-up had spaced 5 ms polls 5-10 ms apart,
    and a new cell waits for the next poll (most of the tailer's p99 latency at 1,000 cells/s)."""
    with logstore.open(sqlite_url, shards=64) as store:
        polls: list[float] = []
        count = store.changed_counts

        def counting(since: object | None = None) -> logstore.ChangedCounts:
            polls.append(time.monotonic())  # only a poll counts the cells
            return count(since)

        monkeypatch.setattr(store, "changed_counts", counting)
        tailer, publisher = held_tailer(store, tmp_path, poll_interval=1.0, idle_poll_interval=1.0)
        store.put_cell(uuid.uuid4(), "BASE", 1, {"n": 1})

        async def scenario() -> float:
            async with tailer:
                await until(lambda: bool(publisher.held), "the cell sent")
                found_at = polls[-1]
                await asyncio.sleep(found_at + 0.5 - time.monotonic())
                publisher.release()  # its acknowledgement wakes the loop half-way to the next poll
                await until(lambda: polls[-1] > found_at, "the next poll", timeout=10)
            return found_at

        found_at = asyncio.run(scenario())
        # One interval after the poll that found the cell; 1.5 s if the loop slept a whole interval from
        # the acknowledgement. The margin is for a loaded machine.
        assert polls[polls.index(found_at) + 1] - found_at < 1.25


def test_the_loop_does_not_spin_while_a_poll_runs_past_the_next_ones_time(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll slower than the poll interval (a loaded database) must not leave the loop turning with
    nothing to wait for until it ends: that burns the CPU the poll itself needs."""
    with logstore.open(sqlite_url, shards=64) as store:
        count = store.changed_counts
        slow = {"on": False}

        def slow_count(since: object | None = None) -> logstore.ChangedCounts:
            if slow["on"]:
                time.sleep(0.5)
            return count(since)

        monkeypatch.setattr(store, "changed_counts", slow_count)
        tailer, _held = held_tailer(store, tmp_path, poll_interval=0.05, idle_poll_interval=0.05)
        turns = {"n": 0}
        lease_valid = tailer.coordinator.lease_valid

        def turn() -> bool:
            turns["n"] += 1  # the loop asks once a turn
            return lease_valid()

        monkeypatch.setattr(tailer.coordinator, "lease_valid", turn)

        async def scenario() -> int:
            async with tailer:
                await asyncio.sleep(0.3)
                slow["on"], before = True, turns["n"]
                await asyncio.sleep(1.0)  # two slow polls, each ten intervals long
                return turns["n"] - before

        during = asyncio.run(scenario())
    # A turn an interval (20 a second) and one at each poll's end; spinning made it thousands.
    assert during < 60


def test_one_slow_poll_does_not_space_out_the_polls_after_it(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Polls are spaced to take a share of the time by what counting costs. A poll held up once (a core
    or the database busy) is not that cost: spaced by it, the next poll came four times its length later,
    and every cell written meanwhile waited for it (the tail of the latency on a loaded machine)."""
    with logstore.open(sqlite_url, shards=64) as store:
        polls: list[tuple[float, float]] = []  # (start, end) of each count
        count = store.changed_counts
        hold = {"next": False}

        def counting(since: object | None = None) -> logstore.ChangedCounts:
            started = time.monotonic()
            if hold["next"]:
                hold["next"] = False
                time.sleep(0.6)
            counted = count(since)
            polls.append((started, time.monotonic()))
            return counted

        monkeypatch.setattr(store, "changed_counts", counting)
        tailer, _held = held_tailer(store, tmp_path, poll_interval=0.05, idle_poll_interval=0.05)

        async def scenario() -> None:
            async with tailer:
                await asyncio.sleep(0.5)  # polls of a few milliseconds each, 50 ms apart
                hold["next"] = True
                await until(lambda: any(end - start >= 0.6 for start, end in polls), "the held poll", timeout=10)
                slow_end = next(end for start, end in polls if end - start >= 0.6)
                await until(lambda: polls[-1][0] > slow_end, "a poll after the held one", timeout=10)

        asyncio.run(scenario())
    slow = next(i for i, (start, end) in enumerate(polls) if end - start >= 0.6)
    # Due 50 ms after the held poll began, so at once when it ends; spaced by its 0.6 s (an idle worker's
    # polls take half the time at most) the next came 1.2 s after its start. The margin is for a loaded machine.
    assert polls[slow + 1][0] - polls[slow][1] < 0.3


@pytest.mark.parametrize("max_in_flight", [20_000, 1])
def test_a_poll_reads_a_shard_whose_last_cells_await_acknowledgement_within_max_in_flight(
    sqlite_url: str, tmp_path: Path, max_in_flight: int
) -> None:
    """Polls read the new cells of drained shards, those whose last cells are still unacknowledged
    included: under load an acknowledgement can take longer than a poll interval, and with one cell a
    put (~16 cells/s a shard at 1,000 cells/s) a cell often lands meanwhile; waiting for the
    acknowledgement and a poll after it was the tailer's p99 latency. Unacknowledged messages stay
    within ``max_in_flight``: a broker that does not answer holds the reading back."""
    with logstore.open(sqlite_url, shards=64) as store:
        tailer, publisher = held_tailer(store, tmp_path, poll_interval=0.05, idle_poll_interval=0.05,
                                        max_in_flight=max_in_flight)
        key = uuid.uuid4()
        store.put_cell(key, "BASE", 1, {"n": 1})

        async def scenario() -> int:
            async with tailer:
                await until(lambda: len(publisher.held) == 1, "the first cell sent")
                store.put_cell(key, "BASE", 2, {"n": 2})  # same row, same shard, behind an unacknowledged cell
                if max_in_flight > 1:
                    await until(lambda: len(publisher.held) == 2, "the second cell sent", timeout=10)
                else:
                    await asyncio.sleep(1.0)  # twenty polls
                sent = len(publisher.held)
                publisher.release()  # else stopping waits for the acknowledgements
                return sent

        assert asyncio.run(scenario()) == (2 if max_in_flight > 1 else 1)


@pytest.mark.parametrize("backend", ["mysql", "sqlite"])
def test_polls_read_the_counters_moved_lately_and_a_late_commit_is_still_read(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A poll reads the counters moved since the previous poll (at 4096 shards, a few rows instead of all
    of them): on MariaDB those touched since, less a margin; on SQLite those of the cells above the last
    poll's highest id. On MariaDB a writer that commits longer than the margin after moving its counter is
    missed by those polls: the complete count the worker takes twice a second reads its cell."""
    url = request.getfixturevalue("mysql_database" if backend == "mysql" else "sqlite_url")
    with logstore.open(url, shards=64) as store:
        [recorder] = store_recorders(store)
        answers: list[bool] = []  # whether each poll's count was complete
        count = store.changed_counts

        def counting(since: object | None = None) -> logstore.ChangedCounts:
            answer = count(since)
            answers.append(answer.complete)
            return answer

        store.changed_counts = counting  # type: ignore[method-assign]
        tailer, publisher = held_tailer(store, tmp_path, poll_interval=0.02, idle_poll_interval=0.02)

        async def scenario() -> None:
            async with tailer:
                await until(lambda: len(answers) > 5, "the first polls")
                recorder.before_commit = lambda shards: time.sleep(3 * TOUCH_MARGIN)
                try:
                    await asyncio.to_thread(store.put_cell, uuid.uuid4(), "BASE", 1, {"n": 1})
                finally:
                    recorder.before_commit = None
                await until(lambda: len(publisher.held) == 1, "the late cell sent", timeout=10)
                publisher.release()

        asyncio.run(scenario())
    # Polls 20 ms apart, a complete one every half second (and more while the loop is slow to start).
    assert answers.count(False) > 3 * answers.count(True), answers
