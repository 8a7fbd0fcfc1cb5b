"""Jobs: long operations (compaction, rebalances, backups...) as durable records with an owner lease, steps,
progress, pause, cancel, resume and one throttle (a rate, and back-off on the load of the nodes a job touches:
:class:`LoadGuard`), run by :class:`JobRunner` (see docs/jobs.md).

A kind of job is a :class:`JobKind` (``plan`` and ``run_step``) registered in a :class:`KindRegistry`.
"""

from __future__ import annotations

from logstore.jobs.kinds import JobKind, KindRegistry, StepContext
from logstore.jobs.load import LoadGuard, NodeLoad, Pressure, ReplicaLag
from logstore.jobs.metrics import JobMetrics, JobRecordsCollector
from logstore.jobs.records import Backoff, JobRecord, JobState, JobStore, StepRecord, ThrottleSettings
from logstore.jobs.runner import JobRunner, RunnerConfig
from logstore.jobs.throttle import Throttle

__all__ = [
    "Backoff",
    "JobKind",
    "JobMetrics",
    "JobRecord",
    "JobRecordsCollector",
    "JobRunner",
    "JobState",
    "JobStore",
    "KindRegistry",
    "LoadGuard",
    "NodeLoad",
    "Pressure",
    "ReplicaLag",
    "RunnerConfig",
    "StepContext",
    "StepRecord",
    "Throttle",
    "ThrottleSettings",
]
