"""Replays and discards started from the console: one background task each, with progress and per-entry results.

A job works through a list of entries fixed when it was confirmed, one at a time, with the same calls as
``cellstream dlq`` (:meth:`~indexer.DeadLetterQueue.replay_async` with the entry's id,
:meth:`~indexer.DeadLetterQueue.discard`): an entry that is no longer open is reported and left alone,
and an interrupted job is resumed by replaying the entries still ``replayed`` or ``open``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from indexer.runtime.dlq_triage import DeadLetterQueue
from logstore.errors import CellstreamError

logger = logging.getLogger(__name__)
Kind = Literal["replay", "discard"]
_KEPT_JOBS = 100


@dataclass(slots=True)
class EntryResult:
    app: str
    id: str
    before: str
    after: str
    error: str | None = None


@dataclass(slots=True)
class Job:
    """One bulk action: what it was asked to do, by whom, and how far it got."""

    id: int
    kind: Kind
    actor: str
    description: str  # the filter, as the person saw it
    targets: list[tuple[str, str]]  # (app, entry id), in the order worked through
    reason: str | None = None
    started: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    finished: dt.datetime | None = None
    state: Literal["running", "done", "cancelled", "failed"] = "running"
    error: str | None = None
    results: list[EntryResult] = field(default_factory=list)
    cancel_requested: bool = False

    @property
    def done(self) -> int:
        return len(self.results)

    @property
    def total(self) -> int:
        return len(self.targets)

    def tally(self) -> dict[str, int]:
        """Results by the entry's state after (``resolved``, ``open``: failed again, ``discarded``, ``error``:
        not changed, see the result)."""
        out: dict[str, int] = {}
        for r in self.results:
            out[r.after] = out.get(r.after, 0) + 1
        return out


class JobRunner:
    """Starts jobs on the running event loop and keeps the last hundred for the jobs page."""

    def __init__(self, queues: Mapping[str, DeadLetterQueue], on_entry: Callable[[Kind, str], None]) -> None:
        self.queues = dict(queues)
        self._on_entry = on_entry  # (kind, the entry's state after): for the metrics
        self._ids = itertools.count(1)
        self.jobs: dict[int, Job] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def start(self, kind: Kind, targets: Sequence[tuple[str, str]], *, actor: str, description: str,
              reason: str | None = None) -> Job:
        job = Job(next(self._ids), kind, actor, description, list(targets), reason)
        self.jobs[job.id] = job
        for old in sorted(self.jobs)[:-_KEPT_JOBS]:
            if self.jobs[old].state != "running":
                del self.jobs[old]
        self._tasks[job.id] = asyncio.create_task(self._run(job), name=f"console-job-{job.id}")
        logger.info("job %d: %s of %d entries by %s (%s)", job.id, kind, job.total, actor, description)
        return job

    def cancel(self, job_id: int) -> Job | None:
        """Stop the job after the entry it is on (an entry is never left half-changed)."""
        job = self.jobs.get(job_id)
        if job is not None and job.state == "running":
            job.cancel_requested = True
        return job

    async def stop(self) -> None:
        """Cancel every running job after its current entry and wait for them."""
        for job in self.jobs.values():
            job.cancel_requested = True
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, job: Job) -> None:
        try:
            for app, entry_id in job.targets:
                if job.cancel_requested:
                    job.state = "cancelled"
                    break
                result = await self._one(job, self.queues[app], entry_id)
                job.results.append(result)
                self._on_entry(job.kind, result.after)
            else:
                job.state = "done"
        except Exception as exc:  # a bug, not an entry's failure: the job stops and says why
            logger.exception("job %d failed", job.id)
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            job.finished = dt.datetime.now(dt.UTC)
            self._tasks.pop(job.id, None)
            logger.info("job %d %s: %s", job.id, job.state, job.tally())

    async def _one(self, job: Job, queue: DeadLetterQueue, entry_id: str) -> EntryResult:
        app = queue.app
        try:
            if job.kind == "replay":
                [r] = await queue.replay_async(entry_id, actor=job.actor)
                return EntryResult(app, entry_id, r.before, r.after, r.error)
            assert job.reason is not None
            after = await asyncio.to_thread(queue.discard, entry_id, job.reason, actor=job.actor)
            # The status before is the one of the event before the discard's own: no second read of the entry.
            return EntryResult(app, entry_id, after.history[-2].status, after.status)
        except CellstreamError as exc:
            # One entry's problem (gone, changed, its handler missing, the store down for it): reported
            # with the entry, and the job goes on with the next.
            return EntryResult(app, entry_id, "?", "error", f"{type(exc).__name__}: {exc}")
