"""The job runner: claims a job's lease, runs its steps in order, and owns everything a kind should not.

- **Lease.** A runner claims a job by writing itself as its owner with a lease expiry (compare-and-set on the
  record: of two runners racing, one wins, the other gets a JobStateError). A heartbeat thread renews the lease
  while a step runs; a job whose owner died (its lease ran out) is claimed by the next runner, which goes on
  from the first unfinished step and that step's recorded cursor.
- **Control.** The heartbeat also reads the record every ``poll_seconds``: a pause (``paused``), a cancel
  (``cancelling``), a new throttle, or another owner (the lease was lost). A step sees the first three at its
  next :meth:`progress` or :meth:`check` (between chunks) as the runner's stop signal;
  the runner then records where it got to and releases the lease (paused), or ends the job (cancelled).
- **Back-off.** Each job's throttle has a :class:`~logstore.jobs.load.LoadGuard` on the nodes its kind names
  (:meth:`~logstore.jobs.kinds.JobKind.load_nodes`, or each chunk's); when it starts or stops holding the job
  back, or something else does, the heartbeat writes why into the record (``backoff``) at its next poll.
- **Retries.** A step that raises a ``retriable`` error runs again after a back-off, up to ``step_attempts``
  runs; then (or at once for another error) the job fails with the error recorded.
- **Progress** is written with the heartbeats and at most every ``progress_seconds`` otherwise, so a job makes
  a few revisions a minute however small its chunks.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from logstore.errors import JobLeaseLostError, JobStateError, LogstoreError
from logstore.jobs.kinds import JobKind, KindRegistry, _JobStop
from logstore.jobs.load import LoadGuard
from logstore.jobs.metrics import JobMetrics
from logstore.jobs.records import JobRecord, JobState, JobStore, StepRecord, ThrottleSettings, now
from logstore.jobs.throttle import Throttle
from logstore.store import Store

logger = logging.getLogger(__name__)


class RunnerConfig(BaseModel):
    """How a runner holds its jobs. The lease bounds how long a job waits after its runner died."""

    model_config = ConfigDict(extra="forbid")

    lease_seconds: float = Field(30.0, gt=0, description="a claim's and a renewal's validity")
    heartbeat_seconds: float | None = Field(None, gt=0, description="renewal period (None: a third of the lease)")
    poll_seconds: float = Field(1.0, gt=0, description="how often the record is read for pause, cancel, throttle")
    progress_seconds: float = Field(5.0, ge=0, description="progress is written at most this often between "
                                                          "heartbeats")
    step_attempts: int = Field(3, ge=1, description="runs of a step before a retriable error fails the job")
    backoff_seconds: float = Field(1.0, ge=0, description="the first retry's wait, doubled at each next one")
    backoff_max_seconds: float = Field(30.0, ge=0)
    load_probe_seconds: float = Field(0.5, gt=0, description="a node a job touches is probed for its load at most "
                                                             "this often (a heartbeat write, a read per replica)")
    load_probe_timeout: float = Field(2.0, gt=0, description="bounds each connection, write and read of a probe: "
                                                            "a node that does not answer is reported down")

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_seconds or self.lease_seconds / 3


def owner_name() -> str:
    """``host:pid:random``: who holds a lease, readable in ``cellstream jobs list``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


class _Session:
    """One runner's hold on one job: its latest record, the running step's progress, the stop signal."""

    def __init__(self, runner: JobRunner, record: JobRecord, guard: LoadGuard | None = None) -> None:
        self.runner = runner
        self.jobs = runner.jobs
        self.record = record
        self.lock = threading.RLock()
        self.stop_reason: str | None = None
        self.step: int | None = None  # index of the running step
        self.done, self.total, self.cursor = 0, None, None  # type: int, int | None, Any
        self.written = time.monotonic()
        throttled = runner.metrics.throttled
        self.throttle = Throttle(record.throttle, stopping=lambda: self.stop_reason is not None, guard=guard,
                                 on_wait=lambda reason, seconds: throttled.labels(record.kind, reason).inc(seconds))
        self.backoff_written: tuple[str, str] | None = None  # what the record says holds the job back

    def _observe(self, record: JobRecord) -> None:
        """Take in what the record says: control, throttle, owner."""
        self.record = record
        if record.owner != self.runner.owner:
            self.stop_reason = "lease lost"
        elif record.state in ("paused", "cancelling") and self.stop_reason is None:
            self.stop_reason = record.state
        if record.throttle != self.throttle.settings:
            logger.info("job %s: throttle now %s", record.id, record.throttle.model_dump(exclude_defaults=True))
            self.throttle.update(record.throttle)

    def write(self, fn: Callable[[JobRecord], None] | None = None, *, release: bool = False) -> JobRecord:
        """Change the record as its owner: the running step's progress, a renewed lease (or none: ``release``),
        then ``fn``. Raises JobLeaseLostError when another runner owns it."""
        lease = self.runner.config.lease_seconds
        backoff = self.throttle.backoff

        def change(record: JobRecord) -> None:
            if record.owner != self.runner.owner:
                raise JobLeaseLostError(f"job {record.id} is owned by {record.owner} now")
            if self.step is not None:
                step = record.steps[self.step]
                step.done, step.total, step.cursor = self.done, self.total, self.cursor
            if release:
                record.owner, record.lease_expires = None, None
            else:
                record.lease_expires = now() + dt.timedelta(seconds=lease)
            record.backoff = None if release else backoff
            if fn is not None:
                fn(record)
        with self.lock:
            try:
                record = self.jobs.change(self.record.id, change)
            except JobLeaseLostError:
                self.stop_reason = "lease lost"
                raise
            self.written = time.monotonic()
            self.backoff_written = None if record.backoff is None else record.backoff.key
            if not release:
                self._observe(record)
            else:
                self.record = record
            return record

    def refresh(self) -> None:
        """Read the record (pause, cancel, throttle, owner); stop when the lease ran out unrenewed."""
        with self.lock:
            self._observe(self.jobs.get(self.record.id))
            if self.record.lease_expires is not None and self.record.lease_expires <= now():
                self.stop_reason = "lease lost"

    def heartbeat(self, stopped: threading.Event) -> None:
        config = self.runner.config
        while not stopped.wait(config.poll_seconds):
            try:
                backoff = self.throttle.backoff
                if (time.monotonic() - self.written >= config.heartbeat
                        or (None if backoff is None else backoff.key) != self.backoff_written):
                    self.write()
                else:
                    self.refresh()
            except JobLeaseLostError:
                logger.error("job %s: lease lost (another runner owns it); stopping", self.record.id)
                return
            except LogstoreError as exc:
                # The store is away: try again at the next poll; the lease expiry stops the job if it stays away.
                logger.warning("job %s: heartbeat failed: %s", self.record.id, exc)
                with self.lock:
                    expires = self.record.lease_expires
                    if expires is not None and expires <= now():
                        self.stop_reason = "lease lost"


class _Context:
    """The :class:`~logstore.jobs.kinds.StepContext` a runner gives one run of a step."""

    def __init__(self, session: _Session, record: JobRecord, step: StepRecord,
                 on_progress: Callable[[JobRecord], None] | None) -> None:
        self._session = session
        self._job = record
        self._cursor = step.cursor
        self._on_progress = on_progress
        self._kind = record.kind

    @property
    def job(self) -> JobRecord:
        return self._job

    @property
    def cursor(self) -> Any:
        return self._cursor

    @property
    def throttle(self) -> Throttle:
        return self._session.throttle

    def check(self) -> None:
        reason = self._session.stop_reason
        if reason is not None:
            raise _JobStop(reason)

    def progress(self, done: int, total: int | None = None, *, cursor: Any = None) -> None:
        session = self._session
        metrics = session.runner.metrics
        with session.lock:
            if done > session.done:
                metrics.units.labels(self._kind).inc(done - session.done)
            session.done, session.cursor = done, cursor
            if total is not None:
                session.total = total
        if time.monotonic() - session.written >= session.runner.config.progress_seconds:
            session.write()
        if self._on_progress is not None:
            self._on_progress(session.runner.snapshot(session))
        self.check()


class JobRunner:
    """Runs jobs of the kinds in ``kinds`` on ``store``.

    Args:
        store: the store holding the job records.
        kinds: the kinds this process can run.
        config: leases, polling, retries.
        owner: the name written as the jobs' owner (None: ``host:pid:random``).
        metrics: where to count (None: a registry of its own).
        on_progress: called (in the step's thread) with the job's record, progress applied, at each report.
    """

    def __init__(self, store: Store, kinds: KindRegistry, config: RunnerConfig | None = None, *,
                 owner: str | None = None, metrics: JobMetrics | None = None,
                 on_progress: Callable[[JobRecord], None] | None = None) -> None:
        self.jobs = JobStore(store)
        self.kinds = kinds
        self.config = config or RunnerConfig()
        self.owner = owner or owner_name()
        self.metrics = metrics or JobMetrics()
        self.on_progress = on_progress

    def submit(self, kind: str, params: dict[str, Any], *, throttle: ThrottleSettings | None = None,
               job_id: str | None = None) -> JobRecord:
        """Plan a job of ``kind`` and record it (state planned); :meth:`run` runs it.

        Raises:
            UnknownJobKindError: no such kind here.
            CellstreamError: the kind refused the parameters.
        """
        found = self.kinds.get(kind)
        steps = found.plan(params)
        record = self.jobs.create(kind, params, steps, unit=found.unit, throttle=throttle, job_id=job_id)
        logger.info("job %s planned: %d steps", record.id, len(steps))
        return record

    def claim(self, job_id: str) -> JobRecord:
        """Take the job's lease: it must wait for a runner (planned) or have lost its owner (lease lapsed).

        Raises:
            JobNotFoundError: no such job.
            UnknownJobKindError: its kind is not known here (checked before the claim).
            JobStateError: it is paused, failed, over, or another live runner holds it.
        """
        self.kinds.get(self.jobs.get(job_id).kind)
        lease = self.config.lease_seconds

        def claim(record: JobRecord) -> None:
            if record.state not in ("planned", "running", "cancelling"):
                hint = " (`cellstream jobs resume` it first)" if record.state in ("paused", "failed") else ""
                raise JobStateError(f"job {job_id} is {record.state}{hint}")
            at = now()
            if not record.lease_lapsed(at) and not record.owner_gone():
                raise JobStateError(f"job {job_id} is run by {record.owner} (lease until "
                                    f"{record.lease_expires.isoformat() if record.lease_expires else '?'})")
            if record.owner is not None:
                why = "whose lease ran out" if record.lease_lapsed(at) else "a process of this host that is gone"
                logger.warning("job %s: taking over from %s, %s", job_id, record.owner, why)
            record.owner, record.lease_expires = self.owner, at + dt.timedelta(seconds=lease)
            if record.state == "planned":
                record.state = "running"
            record.started_at = record.started_at or at
        return self.jobs.change(job_id, claim)

    def run(self, job_id: str) -> JobRecord:
        """Claim the job and run it until it is done, failed, paused or cancelled.

        Returns:
            Its record at the end (state done, failed, paused or cancelled).

        Raises:
            JobNotFoundError, JobStateError, UnknownJobKindError: as :meth:`claim`.
            JobLeaseLostError: the lease was lost (renewals failed for longer than the lease): the job goes on
                in another runner.
        """
        record = self.claim(job_id)
        return self._run(record)

    def run_next(self) -> JobRecord | None:
        """Claim and run the oldest job of a known kind that waits for a runner; None when there is none."""
        for record in self.jobs.jobs():
            if record.kind in self.kinds and record.claimable():
                try:
                    claimed = self.claim(record.id)
                except JobStateError:
                    continue  # another runner was quicker
                return self._run(claimed)
        return None

    def snapshot(self, session: _Session) -> JobRecord:
        """The session's record with the running step's progress applied (for a progress bar)."""
        with session.lock:
            record = session.record.model_copy(deep=True)
            if session.step is not None:
                step = record.steps[session.step]
                step.done, step.total, step.cursor = session.done, session.total, session.cursor
        return record

    def _run(self, record: JobRecord) -> JobRecord:
        kind = self.kinds.get(record.kind)
        metrics = self.metrics
        guard = LoadGuard(self.jobs.store, kind.load_nodes(record), interval=self.config.load_probe_seconds,
                          timeout=self.config.load_probe_timeout, on_probe=metrics.observe_load)
        session = _Session(self, record, guard)
        stopped = threading.Event()
        beat = threading.Thread(target=session.heartbeat, args=(stopped,), name=f"job-{record.id}", daemon=True)
        self.metrics.running.labels(record.kind).inc()
        beat.start()
        logger.info("job %s (%s) running as %s", record.id, record.kind, self.owner)
        try:
            if record.state == "cancelling":
                raise _JobStop("cancelling")
            for index, step in enumerate(record.steps):
                if step.state == "done":
                    continue
                if not self._run_step(session, kind, index):
                    return self._end(session, "failed")
            return self._end(session, "done")
        except _JobStop as stop:
            return self._stop(session, stop.reason)
        except KeyboardInterrupt:
            # Ctrl-C on a foreground run: leave the job paused and resumable rather than waiting out a lease.
            try:
                self._stop(session, "paused")
            except LogstoreError as exc:
                logger.warning("job %s: could not record the pause: %s", record.id, exc)
            raise
        finally:
            stopped.set()
            beat.join()
            guard.close()
            self.metrics.running.labels(record.kind).dec()

    def _run_step(self, session: _Session, kind: JobKind, index: int) -> bool:
        """Run step ``index`` to its end, retrying; False when it failed for good (recorded)."""
        config = self.config
        step = session.record.steps[index]
        with session.lock:
            session.step, session.done, session.total, session.cursor = index, step.done, step.total, step.cursor

        def start(record: JobRecord) -> None:
            found = record.steps[index]
            found.state, found.started_at = "running", found.started_at or now()
        session.write(start)
        while True:
            step = session.record.steps[index]
            context = _Context(session, session.record, step, self.on_progress)
            context.check()
            try:
                kind.run_step(step.model_copy(deep=True), context)
            except Exception as exc:
                retriable = bool(getattr(exc, "retriable", False))
                text = f"{type(exc).__name__}: {exc}"
                attempts = step.attempts + 1
                final = not retriable or attempts >= config.step_attempts
                logger.log(logging.ERROR if final else logging.WARNING, "job %s step %s failed (attempt %d%s): %s",
                           session.record.id, step.name, attempts, "" if final else ", retrying", text,
                           exc_info=final)

                def failed(record: JobRecord, attempts: int = attempts, text: str = text, final: bool = final) -> None:
                    found = record.steps[index]
                    found.attempts, found.error, record.error = attempts, text, text
                    if final:
                        found.state = "failed"
                session.write(failed)
                self.metrics.steps.labels(kind.name, "failed" if final else "retried").inc()
                if final:
                    return False
                self._back_off(session, attempts)
                continue
            with session.lock:
                if session.total is None:
                    session.total = session.done

            def finish(record: JobRecord) -> None:
                found = record.steps[index]
                found.state, found.finished_at, found.error = "done", now(), None
            session.write(finish)
            with session.lock:
                session.step = None
            self.metrics.steps.labels(kind.name, "done").inc()
            return True

    def _back_off(self, session: _Session, attempts: int) -> None:
        delay = min(self.config.backoff_max_seconds, self.config.backoff_seconds * 2 ** (attempts - 1))
        until = time.monotonic() + delay
        while time.monotonic() < until:
            if session.stop_reason is not None:
                raise _JobStop(session.stop_reason)
            time.sleep(min(0.1, until - time.monotonic()))

    def _end(self, session: _Session, state: JobState) -> JobRecord:
        def end(record: JobRecord) -> None:
            record.state, record.finished_at = state, now()
            if state == "done":
                record.error = None
        record = session.write(end, release=True)
        self.metrics.finished.labels(record.kind, state).inc()
        logger.info("job %s %s: %d %s", record.id, state, record.done, record.unit)
        return record

    def _stop(self, session: _Session, reason: str) -> JobRecord:
        if reason == "lease lost":
            self.metrics.finished.labels(session.record.kind, "lease_lost").inc()
            raise JobLeaseLostError(f"job {session.record.id}: this runner lost its lease; another may run it")

        def stop(record: JobRecord) -> None:
            if record.state == "cancelling":
                record.state, record.finished_at = "cancelled", now()
            elif record.state in ("running", "planned"):
                record.state = "paused"
            if record.steps and session.step is not None and record.steps[session.step].state == "running":
                record.steps[session.step].state = "planned"
        try:
            record = session.write(stop, release=True)
        except JobLeaseLostError:
            self.metrics.finished.labels(session.record.kind, "lease_lost").inc()
            raise
        self.metrics.finished.labels(record.kind, record.state).inc()
        logger.info("job %s %s at %d %s", record.id, record.state, record.done, record.unit)
        return record
