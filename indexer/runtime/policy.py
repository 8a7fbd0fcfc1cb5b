"""Retries and dead-lettering, decided in one place (like dramatiq's Retries middleware).

A handler call is attempted up to ``max_attempts`` times with exponential backoff and
jitter between attempts (:class:`logstore.retry.RetryPolicy` gives the delays). An
exception that is marked non-retriable (``retriable = False``, e.g.
:class:`~indexer.errors.NonRetriableError`) and a cell that cannot be decoded end the
attempts at once. The outcome says whether to acknowledge the cell or dead-letter it,
with everything the dead letter records; nothing here swallows an error silently.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import re
import traceback
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from indexer.runtime.clock import SYSTEM_CLOCK
from logstore import CorruptCellError
from logstore.retry import RetryPolicy

DECODE_ERRORS: tuple[type[BaseException], ...] = (CorruptCellError, UnicodeDecodeError, json.JSONDecodeError)
DEFAULT_BACKOFF = RetryPolicy(initial=0.1, maximum=10.0, multiplier=2.0, jitter=0.5, deadline=None)
_VOLATILE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|0x[0-9a-f]+|\d+", re.I)


class Failure(NamedTuple):
    """The last error of a delivery that did not succeed."""

    error_type: str  # qualified class name
    message: str
    traceback: str
    fingerprint: str  # groups failures with the same cause (see fingerprint())
    retriable: bool


class Outcome(NamedTuple):
    """What became of one cell for one handler."""

    ok: bool
    attempts: int
    failure: Failure | None = None
    first_failure: dt.datetime | None = None
    last_failure: dt.datetime | None = None


def is_retriable(exc: BaseException) -> bool:
    """Retry unless the exception says it is pointless: ``retriable = False`` or a decode error."""
    if isinstance(exc, DECODE_ERRORS):
        return False
    return bool(getattr(exc, "retriable", True))


def fingerprint(exc: BaseException) -> str:
    """A short hash of the error class, its message with numbers and ids blanked, and where it was raised,
    so that one cause failing on many cells is one group in ``dlq stats``."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = ";".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in frames)
    text = f"{qualified_name(type(exc))}|{_VOLATILE.sub('#', str(exc))[:200]}|{where}"
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def qualified_name(kind: type[BaseException]) -> str:
    module = kind.__module__
    return kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"


def describe(exc: BaseException) -> Failure:
    text = "".join(traceback.format_exception(exc))
    return Failure(qualified_name(type(exc)), str(exc), text[-16_000:], fingerprint(exc), is_retriable(exc))


async def deliver(
    call: Callable[[], Awaitable[object]],
    max_attempts: int,
    backoff: RetryPolicy = DEFAULT_BACKOFF,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    now: Callable[[], dt.datetime] = SYSTEM_CLOCK.now,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    failed: BaseException | None = None,
) -> Outcome:
    """Call until it succeeds, the error is not retriable, or ``max_attempts`` calls failed. ``failed``: the
    first attempt was made already (a run of cells in one trip to a thread) and raised this. ``sleep`` waits
    between attempts and ``now`` dates the failures (an app's clock)."""
    delays = backoff.delays()
    first: dt.datetime | None = None
    attempt = 0
    while True:
        attempt += 1
        try:
            if failed is not None:
                raised, failed = failed, None
                raise raised
            await call()
        except Exception as exc:  # the handler's own errors: never let one escape the runtime
            at = now()
            first = first or at
            if attempt >= max_attempts or not is_retriable(exc):
                return Outcome(False, attempt, describe(exc), first, at)
            delay = next(delays)
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            await sleep(delay)
        else:
            return Outcome(True, attempt, None, first, None if first is None else now())
