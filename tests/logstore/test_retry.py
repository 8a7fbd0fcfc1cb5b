from __future__ import annotations

import asyncio

import pytest

from logstore.errors import CellConflictError, StorageUnavailableError
from logstore.retry import RetryPolicy, retry_call, retry_call_async


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(times: int, error: Exception) -> object:
    calls = {"n": 0}

    def fn() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise error
        return "ok"

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def test_retries_retriable_errors_with_capped_exponential_backoff() -> None:
    clock = Clock()
    fn = failing(5, StorageUnavailableError("down"))
    policy = RetryPolicy(initial=0.1, maximum=0.5, multiplier=2, jitter=0, deadline=None)
    assert retry_call(fn, policy, sleep=clock.sleep, clock=lambda: clock.now) == "ok"  # type: ignore[arg-type]
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_jitter_stays_inside_its_fraction() -> None:
    clock = Clock()
    fn = failing(3, StorageUnavailableError("down"))
    policy = RetryPolicy(initial=1, maximum=1, jitter=0.5, deadline=None)
    retry_call(fn, policy, sleep=clock.sleep, clock=lambda: clock.now, random=lambda: 0.0)  # type: ignore[arg-type]
    assert clock.sleeps == [0.5, 0.5, 0.5]


def test_non_retriable_errors_are_raised_at_once() -> None:
    clock = Clock()
    fn = failing(1, CellConflictError("k", "C", 1))
    with pytest.raises(CellConflictError):
        retry_call(fn, RetryPolicy(), sleep=clock.sleep, clock=lambda: clock.now)  # type: ignore[arg-type]
    assert clock.sleeps == []


def test_deadline_and_max_attempts_bound_the_retries() -> None:
    clock = Clock()
    fn = failing(100, StorageUnavailableError("down"))
    with pytest.raises(StorageUnavailableError):
        retry_call(fn, RetryPolicy(initial=1, maximum=1, jitter=0, deadline=3.5),  # type: ignore[arg-type]
                   sleep=clock.sleep, clock=lambda: clock.now)
    assert clock.sleeps == [1, 1, 1, 0.5]
    fn = failing(100, StorageUnavailableError("down"))
    with pytest.raises(StorageUnavailableError):
        retry_call(fn, RetryPolicy(max_attempts=3, deadline=None), sleep=lambda s: None)  # type: ignore[arg-type]
    assert fn.calls["n"] == 3  # type: ignore[attr-defined]


def test_async_variant_shares_the_policy() -> None:
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    attempts = {"n": 0}

    async def fn() -> int:
        attempts["n"] += 1
        if attempts["n"] < 3:
            raise StorageUnavailableError("down")
        return 7

    policy = RetryPolicy(initial=0.2, jitter=0, deadline=None)
    assert asyncio.run(retry_call_async(fn, policy, sleep=sleep)) == 7
    assert sleeps == pytest.approx([0.2, 0.4])
