"""Jobs: long operations (compaction, rebalances, backups...) as durable records with an owner lease, steps,
progress, pause, cancel, resume and one throttle, run by :class:`JobRunner` (see docs/jobs.md).

A kind of job is a :class:`JobKind` (``plan`` and ``run_step``) registered in a :class:`KindRegistry`.
"""

from __future__ import annotations

from logstore.jobs.kinds import JobKind, KindRegistry, StepContext
from logstore.jobs.metrics import JobMetrics, JobRecordsCollector
from logstore.jobs.records import JobRecord, JobState, JobStore, StepRecord, ThrottleSettings
from logstore.jobs.runner import JobRunner, RunnerConfig
from logstore.jobs.throttle import Throttle

__all__ = [
    "JobKind",
    "JobMetrics",
    "JobRecord",
    "JobRecordsCollector",
    "JobRunner",
    "JobState",
    "JobStore",
    "KindRegistry",
    "RunnerConfig",
    "StepContext",
    "StepRecord",
    "Throttle",
    "ThrottleSettings",
]
