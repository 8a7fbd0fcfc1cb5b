"""The worker's poll schedule: fast while cells arrive, backing off only once they have stopped."""

from __future__ import annotations

from tailer.polling import PollSchedule


def test_a_look_that_finds_nothing_right_after_cells_keeps_the_fast_interval() -> None:
    """At 250 writes a second a quarter of the 5 ms windows are empty: those looks must not slow the
    next one down (backing off at once had doubled the latency of such a stream)."""
    polls = PollSchedule(0.005, 0.05)
    now = 0.0
    for found in [True, False, True, False, False, True, False, False, False] * 20:
        now += polls.interval
        assert polls.looked(now, active=found) == 0.005


def test_quiet_for_the_longest_wait_backs_off_by_doubling_up_to_it_and_cells_reset_it() -> None:
    polls = PollSchedule(0.25, 4.0)  # binary fractions: the sums of the waits are exact
    assert polls.looked(0.0, active=True) == 0.25
    waits, now = [], 0.0
    for _ in range(20):
        now += polls.interval
        waits.append(polls.looked(now, active=False))
    # Fast until 4 s of quiet, then doubling: 0.5, 1, 2, and 4 from there on.
    assert waits == [0.25] * 15 + [0.5, 1.0, 2.0, 4.0, 4.0]
    assert polls.looked(now + 4.0, active=True) == 0.25


def test_a_worker_that_never_saw_a_cell_backs_off_from_its_first_look() -> None:
    polls = PollSchedule(0.005, 0.05)
    assert [polls.looked(t, active=False) for t in (0.0, 0.01, 0.03)] == [0.01, 0.02, 0.04]
