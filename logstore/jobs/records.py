"""Job records: every long operation's state as system cells in the store itself (Citus keeps its rebalances
as rows of ``pg_dist_background_job``; cellstream keeps its jobs as cells).

A job's record is the cell ``(row key of its id, "_job", revision)``; each change writes the next revision with
the whole record, so a change is atomic (one cell) and two concurrent changes meet as a CellConflictError, after
which the loser reads the new record and applies its change again (compare-and-set), as the index catalog does.

All jobs of a store live in one shard (the *jobs shard*, chosen by hashing a fixed name; each job's row key is
derived from its id and chosen to fall there, as the dead-letter store does per app), so listing them reads one
shard's log, filtered to ``_job``, instead of every shard. A :class:`JobStore` remembers where its last listing
ended, so listing again (a dashboard's scrape, ``cellstream jobs list`` in a loop) reads only what was written
since.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from logstore.cell import key_in_shard, shard_of
from logstore.errors import CellConflictError, InvalidArgumentError, JobNotFoundError, JobStateError
from logstore.persistence import TruncatedPage
from logstore.store import Store

logger = logging.getLogger(__name__)
JOB_COLUMN = "_job"
_NAMESPACE = uuid.UUID("3a9d5c1e-2b7f-4e60-8d1a-6c4b0f9e7a23")
_PAGE = 1000
_WRITE_TRIES = 16
JobState = Literal["planned", "running", "paused", "cancelling", "cancelled", "done", "failed"]
JOB_STATES: tuple[str, ...] = get_args(JobState)
StepState = Literal["planned", "running", "done", "failed"]
# A runner may hold these; the others wait for a command (paused, failed) or are over (cancelled, done).
ACTIVE_STATES: frozenset[str] = frozenset({"planned", "running", "cancelling"})
FINAL_STATES: frozenset[str] = frozenset({"cancelled", "done"})


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class ThrottleSettings(BaseModel):
    """How fast a job may go, read by its runner at every heartbeat (``cellstream jobs throttle`` changes it)."""

    model_config = ConfigDict(extra="forbid")

    rate: float | None = Field(None, gt=0, description="units per second (a token bucket); None: unlimited")
    burst_seconds: float = Field(1.0, gt=0, description="the bucket holds this many seconds of `rate`")
    concurrency: int = Field(1, ge=1, description="units a kind may work on at once (files, shards)")
    pause_seconds: float = Field(0.0, ge=0, description="a pause after every chunk, on top of the rate")
    # gh-ost's --nice-ratio: a pause in proportion to the work, whatever its cost is made of (a shard move's
    # statements cost the same for 2 cells as for 200, which a rate of cells does not see).
    nice_ratio: float = Field(0.0, ge=0, description="after every chunk, a pause of this many times the time the "
                                                     "chunk took: 1 keeps the job at work half of the time")
    # Back-off on the load of the nodes a chunk touched (logstore.jobs.load): the lag default is
    # pt-online-schema-change's and Vitess's throttler's; the latency default is the write p99 the project
    # promises during a rebalance (issue 51).
    max_lag_seconds: float | None = Field(1.0, gt=0, description="back off while a replica of a node the job "
                                          "touches lags more; None: never for lag")
    max_latency_ms: float | None = Field(50.0, gt=0, description="back off while a node's write latency (the "
                                         "median of its last heartbeat writes) is higher; None: never for latency")


BackoffCause = Literal["lag", "latency"]


class Backoff(BaseModel):
    """Why a job waits on the load of a node (not on its rate), since when: ``cellstream jobs show`` says it."""

    model_config = ConfigDict(extra="forbid")

    cause: BackoffCause = Field(description="lag: a replica lags; latency: a node's writes are slow")
    node: str = Field(description="the storage node")
    subject: str = Field(description="what holds the job back: 'node b', 'replica 127.0.0.1:3307 of node b'")
    detail: str = Field(description="e.g. 'replica 127.0.0.1:3307 of node b lags 3.4 s > 1 s' (as last probed)")
    since: dt.datetime = Field(description="when this subject started holding the job back")

    @property
    def key(self) -> tuple[str, str]:
        """What stays the same while the same thing holds the job back (the detail's numbers change)."""
        return self.cause, self.subject


class StepRecord(BaseModel):
    """One step of a job: what its kind planned, and how far it got."""

    model_config = ConfigDict(extra="forbid")

    name: str
    params: dict[str, Any] = Field(default_factory=dict, description="what the kind needs to run the step")
    state: StepState = "planned"
    done: int = Field(0, description="units done")
    total: int | None = Field(None, description="units in all, when the kind knows")
    cursor: Any = Field(None, description="where the step goes on from (JSON, the kind's own)")
    attempts: int = Field(0, description="runs of the step that failed")
    error: str | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None


class JobRecord(BaseModel):
    """One job (the body of its latest record cell, and the revision of that cell)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    revision: int = Field(0, description="the ref_key of the cell holding this record (not in the body)")
    kind: str
    params: dict[str, Any] = Field(default_factory=dict)
    state: JobState = "planned"
    owner: str | None = Field(None, description="the runner holding the lease (host:pid:random)")
    lease_expires: dt.datetime | None = None
    steps: list[StepRecord] = Field(default_factory=list)
    throttle: ThrottleSettings = Field(default_factory=ThrottleSettings)
    backoff: Backoff | None = Field(None, description="set while the job waits on a node's load (written by its "
                                                      "runner within a poll)")
    unit: str = Field("units", description="what the steps' done and total count (cells, files, bytes)")
    created_at: dt.datetime
    started_at: dt.datetime | None = None
    updated_at: dt.datetime
    finished_at: dt.datetime | None = None
    error: str | None = Field(None, description="the last error (of a step's failed attempt or of the job)")

    @field_validator("id")
    @classmethod
    def _short_id(cls, value: str) -> str:
        if not value or len(value) > 64 or not value.isascii() or not value.replace("-", "").isalnum():
            raise ValueError(f"{value!r} is not a job id (letters, digits and '-', e.g. compact-7f3a2c)")
        return value

    @property
    def done(self) -> int:
        return sum(s.done for s in self.steps)

    @property
    def total(self) -> int | None:
        """Units in all; None while a step's total is unknown."""
        totals = [s.total for s in self.steps]
        return None if any(t is None for t in totals) else sum(t or 0 for t in totals)

    def lease_lapsed(self, at: dt.datetime | None = None) -> bool:
        """No live owner: none, or one whose lease ran out (it died, or lost the store)."""
        return self.owner is None or self.lease_expires is None or self.lease_expires <= (at or now())

    def owner_gone(self) -> bool:
        """Its owner is a process of this host that no longer runs (killed): no need to wait out its lease.
        (A pid used again by another process meanwhile makes this False: the lease is then waited out.)"""
        if self.owner is None:
            return False
        host, _, rest = self.owner.partition(":")
        pid = rest.partition(":")[0]
        if host != socket.gethostname() or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def claimable(self, at: dt.datetime | None = None) -> bool:
        """A runner may take the job now: it waits for one, or its owner's lease ran out."""
        return self.state in ACTIVE_STATES and self.lease_lapsed(at)

    def summary(self) -> dict[str, Any]:
        """The fields ``cellstream jobs list`` shows."""
        return {"id": self.id, "kind": self.kind, "state": self.state, "done": self.done, "total": self.total,
                "unit": self.unit, "steps_done": sum(1 for s in self.steps if s.state == "done"),
                "steps": len(self.steps), "owner": self.owner, "updated_at": self.updated_at.isoformat(),
                "error": self.error, "backoff": None if self.backoff is None else self.backoff.detail}

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def new_job_id(kind: str) -> str:
    """``<kind>-<6 hex digits>``: short enough to type, and a retry when taken (:meth:`JobStore.create`)."""
    return f"{kind}-{secrets.token_hex(3)}"


class JobStore:
    """The job records of one store: create, read, list and change them (compare-and-set).

    Thread-safe: a runner's heartbeat and its steps change the same record from two threads.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.shard = shard_of(uuid.uuid5(_NAMESPACE, "jobs"), store.shard_count)
        self._keys: dict[str, uuid.UUID] = {}
        self._location = 0
        self._latest: dict[str, tuple[int, dict[str, Any]]] = {}  # job id -> (revision, body)
        self._lock = threading.Lock()

    def row_key(self, job_id: str) -> uuid.UUID:
        key = self._keys.get(job_id)
        if key is None:
            key = self._keys[job_id] = key_in_shard(_NAMESPACE, job_id, self.shard, self.store.shard_count)
        return key

    def get(self, job_id: str) -> JobRecord:
        """The job's latest record.

        Raises:
            JobNotFoundError: no job has this id.
            StorageUnavailableError: the store did not answer (retriable).
        """
        cell = self.store.get_cell_latest(self.row_key(job_id), JOB_COLUMN)
        if cell is None or cell.body.get("id") != job_id:
            raise JobNotFoundError(f"no job {job_id!r} (`cellstream jobs list --all` lists them)")
        return JobRecord.model_validate({**cell.body, "revision": cell.ref_key})

    def jobs(self) -> list[JobRecord]:
        """The latest record of every job of the store, oldest first: one read of what the jobs shard got
        since the previous call."""
        with self._lock:
            while True:
                page, self._location = self.store.get_cells_for_shard(self.shard, self._location, _PAGE,
                                                                      columns=[JOB_COLUMN])
                for cell in page:
                    job_id = str(cell.body.get("id"))
                    if cell.ref_key > self._latest.get(job_id, (0, {}))[0]:
                        self._latest[job_id] = (cell.ref_key, cell.body)
                if len(page) < _PAGE and not isinstance(page, TruncatedPage):
                    break
            latest = list(self._latest.values())
        out = [JobRecord.model_validate({**body, "revision": revision}) for revision, body in latest]
        return sorted(out, key=lambda j: (j.created_at, j.id))

    def create(self, kind: str, params: dict[str, Any], steps: list[StepRecord], *, unit: str = "units",
               throttle: ThrottleSettings | None = None, job_id: str | None = None) -> JobRecord:
        """Record a new job, state planned: a runner (``cellstream jobs resume ID --run``, or the command that
        made it) runs it.

        Args:
            kind: the kind's name in the registry.
            params: the kind's parameters (JSON).
            steps: the steps its kind planned, in order.
            unit: what the steps count.
            throttle: the settings to start with (None: unlimited).
            job_id: the id to give it (None: ``<kind>-<6 hex digits>``).

        Raises:
            JobStateError: ``job_id`` is taken.
            InvalidArgumentError: the record is not valid (an id that is not one, parameters that are not JSON).
        """
        at = now()
        for _ in range(_WRITE_TRIES):
            record = JobRecord(id=job_id or new_job_id(kind), kind=kind, params=params, steps=steps, unit=unit,
                               throttle=throttle or ThrottleSettings(), created_at=at, updated_at=at)
            try:
                return self._write(record, 1)
            except CellConflictError:
                if job_id is not None:
                    raise JobStateError(f"job {job_id} exists already") from None
        raise JobStateError(f"no free job id for kind {kind} after {_WRITE_TRIES} tries")

    def change(self, job_id: str, fn: Callable[[JobRecord], None]) -> JobRecord:
        """Apply ``fn`` to the latest record and write it as the next revision, again on the newer record when
        another process wrote first. ``fn`` may raise (JobStateError) to refuse the change: nothing is written.

        Raises:
            JobNotFoundError: no job has this id.
            JobStateError: ``fn`` refused, or the record kept changing under this process.
        """
        for _ in range(_WRITE_TRIES):
            record = self.get(job_id)
            fn(record)
            record.updated_at = now()
            try:
                return self._write(record, record.revision + 1)
            except CellConflictError:
                continue  # another process changed it first: again, on its record
        raise JobStateError(f"job {job_id}: the record changed {_WRITE_TRIES} times while this change was made")

    def _write(self, record: JobRecord, revision: int) -> JobRecord:
        try:
            body = JobRecord.model_validate(record.model_dump()).model_dump(mode="json", exclude={"revision"})
        except ValueError as exc:
            raise InvalidArgumentError(f"job {record.id}: {exc}") from None
        self.store.put_system_cells([(self.row_key(record.id), JOB_COLUMN, revision, body)])
        return record.model_copy(update={"revision": revision})

    # -- the commands --------------------------------------------------------------------------
    def pause(self, job_id: str) -> JobRecord:
        """Ask the job to stop after its current chunk, keeping its place (its runner releases the lease)."""
        def pause(record: JobRecord) -> None:
            if record.state == "paused":
                return
            if record.state not in ("planned", "running"):
                raise JobStateError(f"job {job_id} is {record.state}: only a planned or running job pauses")
            record.state = "paused"
        return self.change(job_id, pause)

    def resume(self, job_id: str) -> JobRecord:
        """Make a paused or failed job wait for a runner again (state planned), from its first unfinished step
        and that step's cursor; a failed step gets its attempts back."""
        def resume(record: JobRecord) -> None:
            if record.state in ("planned", "running"):
                return
            if record.state not in ("paused", "failed"):
                raise JobStateError(f"job {job_id} is {record.state}: only a paused or failed job resumes")
            for step in record.steps:
                if step.state == "failed":
                    step.state, step.attempts = "planned", 0
            record.state, record.finished_at = "planned", None
        return self.change(job_id, resume)

    def cancel(self, job_id: str) -> JobRecord:
        """Stop the job for good: a running one is ``cancelling`` until its runner stops after the current
        chunk; one that no live runner holds is ``cancelled`` at once. Steps done stay done (a kind's steps
        leave the data consistent at every chunk)."""
        def cancel(record: JobRecord) -> None:
            if record.state in ("cancelled", "cancelling"):
                return
            if record.state == "done":
                raise JobStateError(f"job {job_id} is done: there is nothing to cancel")
            if record.state == "running" and not record.lease_lapsed():
                record.state = "cancelling"
            else:
                record.state, record.finished_at, record.owner, record.lease_expires = "cancelled", now(), None, None
        return self.change(job_id, cancel)

    def set_throttle(self, job_id: str, **settings: Any) -> JobRecord:
        """Change the job's throttle (``rate``, ``burst_seconds``, ``concurrency``, ``pause_seconds``,
        ``max_lag_seconds``, ``max_latency_ms``; a None rate lifts the limit, a None maximum turns that back-off
        off); its runner applies it at its next poll.

        Raises:
            InvalidArgumentError: a setting that is not valid.
        """
        def throttle(record: JobRecord) -> None:
            if record.state in FINAL_STATES:
                raise JobStateError(f"job {job_id} is {record.state}: its throttle no longer matters")
            try:
                record.throttle = ThrottleSettings.model_validate({**record.throttle.model_dump(), **settings})
            except ValueError as exc:
                raise InvalidArgumentError(f"job {job_id}: throttle: {exc}") from None
        return self.change(job_id, throttle)
