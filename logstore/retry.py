"""One retry helper for every layer: exponential backoff, full jitter, a deadline.

Only errors the caller marks retriable are retried (by default: ``exc.retriable``).
``sleep``, ``clock`` and ``random`` are injectable so tests run without waiting.
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RetryPolicy(BaseModel):
    """Backoff ``initial * multiplier**n`` capped at ``maximum``, with jitter, until ``deadline``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    initial: float = Field(0.05, gt=0)
    maximum: float = Field(2.0, gt=0)
    multiplier: float = Field(2.0, ge=1)
    jitter: float = Field(0.5, ge=0, le=1, description="fraction of each delay drawn at random")
    deadline: float | None = Field(15.0, gt=0, description="seconds from the first attempt")
    max_attempts: int | None = Field(None, ge=1)

    def delays(self, random: Callable[[], float] = _random.random) -> Iterator[float]:
        delay = self.initial
        while True:
            yield delay * (1 - self.jitter) + delay * self.jitter * random()
            delay = min(delay * self.multiplier, self.maximum)


def _is_retriable(exc: BaseException) -> bool:
    return bool(getattr(exc, "retriable", False))


class _Attempts:
    """The bookkeeping shared by the sync and async loops."""

    def __init__(
        self,
        policy: RetryPolicy,
        retriable: Callable[[BaseException], bool],
        clock: Callable[[], float],
        random: Callable[[], float],
    ) -> None:
        self.policy = policy
        self.retriable = retriable
        self.clock = clock
        self.start = clock()
        self.attempt = 0
        self.delays = policy.delays(random)

    def next_delay(self, exc: BaseException) -> float | None:
        """The pause before the next attempt, or None when ``exc`` must be raised."""
        self.attempt += 1
        if not self.retriable(exc):
            return None
        if self.policy.max_attempts is not None and self.attempt >= self.policy.max_attempts:
            return None
        delay = next(self.delays)
        if self.policy.deadline is not None:
            left = self.policy.deadline - (self.clock() - self.start)
            if left <= 0:
                return None
            delay = min(delay, left)
        logger.debug("attempt %d failed (%s); retrying in %.3fs", self.attempt, exc, delay)
        return delay


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy | None = None,
    *,
    retriable: Callable[[BaseException], bool] = _is_retriable,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    random: Callable[[], float] = _random.random,
) -> T:
    attempts = _Attempts(policy or RetryPolicy(), retriable, clock, random)
    while True:
        try:
            return fn()
        except Exception as exc:
            delay = attempts.next_delay(exc)
            if delay is None:
                raise
        sleep(delay)


async def retry_call_async(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy | None = None,
    *,
    retriable: Callable[[BaseException], bool] = _is_retriable,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    random: Callable[[], float] = _random.random,
) -> T:
    attempts = _Attempts(policy or RetryPolicy(), retriable, clock, random)
    while True:
        try:
            return await fn()
        except Exception as exc:
            delay = attempts.next_delay(exc)
            if delay is None:
                raise
        await sleep(delay)
