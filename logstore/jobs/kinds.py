"""What a job kind is: a small class that plans steps and runs one step, and the registry of kinds by name.

The runner (:mod:`logstore.jobs.runner`) owns everything else: the lease, retries, pause and cancel, progress,
metrics. A kind's :meth:`JobKind.run_step` works in chunks and, between chunks, reports its progress and cursor
(:meth:`StepContext.progress`, which also raises the runner's stop signal when the job must stop) and waits on
the throttle. A step must be safe to run again from its last recorded cursor after a crash: either its effect
is idempotent (cells are immutable: writing the same cell twice is a no-op), or the kind writes its own cursor
in the same transaction as its effect and reads it back when the step starts (Vitess's copy state).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol

from logstore.errors import UnknownJobKindError
from logstore.jobs.records import JobRecord, StepRecord
from logstore.jobs.throttle import Throttle


class _JobStop(BaseException):  # a signal to unwind, as asyncio.CancelledError is; the runner catches it
    """Raised inside a step when the job must stop after this chunk: paused, cancelled, or its lease lost.

    A BaseException, so that a kind's ``except Exception`` (to retry a chunk, say) does not swallow it; a kind
    never names it, and lets it through (cleaning up in ``finally``).
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason  # "paused", "cancelling" or "lease lost"
        super().__init__(reason)


class StepContext(Protocol):
    """What a step gets from its runner."""

    @property
    def job(self) -> JobRecord:
        """The job's record as the step started (its id, kind, params)."""

    @property
    def cursor(self) -> Any:
        """The step's cursor as last recorded (None: from the start)."""

    @property
    def throttle(self) -> Throttle:
        """Wait on it between chunks: ``context.throttle.wait(units)``, or ``wait(units, nodes=[...])`` to
        back off on the load of the nodes that chunk touched (else those of :meth:`JobKind.load_nodes`); it
        raises NodeDownError when one of them is down. ``context.throttle.guard.down(nodes)`` tells which
        nodes are down before a unit starts."""

    def progress(self, done: int, total: int | None = None, *, cursor: Any = None) -> None:
        """Report the step's units done (in all, not since the last call), its total when known, and the
        cursor to go on from (JSON). Recorded at most every few seconds and at the step's end; raises
        the runner's stop signal when the job must stop."""

    def check(self) -> None:
        """Raise the runner's stop signal when the job must stop (paused, cancelled, lease lost)."""


class JobKind(abc.ABC):
    """One kind of long operation (compaction, a rebalance, a backup...).

    Subclasses set ``name`` (the registry's key, also the prefix of their jobs' ids) and ``unit`` (what their
    steps count), and implement :meth:`plan` and :meth:`run_step`.
    """

    name: ClassVar[str]
    unit: ClassVar[str] = "units"

    @abc.abstractmethod
    def plan(self, params: dict[str, Any]) -> list[StepRecord]:
        """The steps of a job with these parameters, in the order they run.

        Raises:
            CellstreamError: the parameters do not make a job (ConfigurationError, InvalidArgumentError).
        """

    @abc.abstractmethod
    def run_step(self, step: StepRecord, context: StepContext) -> None:
        """Do one step, from ``context.cursor`` on; return when it is done.

        Raises:
            the runner's stop signal (a BaseException) from ``context``: let it through.
            CellstreamError: the step failed; the runner tries again (with back-off) when ``retriable``.
        """

    def load_nodes(self, record: JobRecord) -> Sequence[str]:
        """The storage nodes every chunk of the job touches, whose load (replica lag, write latency) its throttle
        backs off on between chunks. None here: a kind whose chunks touch other nodes each time names them at
        each ``context.throttle.wait(units, nodes=...)``; a kind that spares no node's traffic names none."""
        return ()

    def describe(self, record: JobRecord) -> str:
        """One line on what the job does, for ``cellstream jobs show``."""
        return f"{self.name} {record.params}"

    def details(self, record: JobRecord) -> list[str]:
        """Lines on where the job's steps are, beyond their counts, for ``cellstream jobs show`` (a kind whose
        cursor says more, e.g. each shard of a rebalance, overrides this)."""
        return []


class KindRegistry:
    """The job kinds a process knows, by name."""

    def __init__(self, kinds: Iterable[JobKind] = ()) -> None:
        self._kinds: dict[str, JobKind] = {}
        for kind in kinds:
            self.add(kind)

    def add(self, kind: JobKind) -> None:
        """Know ``kind`` (again: the last one added wins, e.g. a test's instance)."""
        self._kinds[kind.name] = kind

    def get(self, name: str) -> JobKind:
        """Raises UnknownJobKindError when no kind has this name."""
        kind = self._kinds.get(name)
        if kind is None:
            known = ", ".join(sorted(self._kinds)) or "none"
            raise UnknownJobKindError(f"job kind {name!r} is not known to this process (known: {known})")
        return kind

    def names(self) -> list[str]:
        return sorted(self._kinds)

    def __contains__(self, name: object) -> bool:
        return name in self._kinds
