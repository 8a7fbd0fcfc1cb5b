"""Prometheus metrics of jobs: what a runner did (counters of its process), and what the records say (read from
the store at each scrape, so a job whose runner died is still seen: its lease lapsed with no one to renew it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from logstore.build_info import register_build_info
from logstore.errors import LogstoreError
from logstore.jobs.records import FINAL_STATES, JOB_STATES, now

if TYPE_CHECKING:
    from logstore.jobs.load import NodeLoad
    from logstore.jobs.records import JobStore

logger = logging.getLogger(__name__)


class JobMetrics:
    """The metrics of the runners of one process; ``watch(jobs)`` adds those of the store's records."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        if registry is None:
            register_build_info(r, "jobs")
        self.units = Counter("cellstream_job_units", "Units (cells, files, bytes) the steps of jobs did here",
                             ["kind"], registry=r)
        self.steps = Counter("cellstream_job_steps", "Step runs here, by result: done, retried (failed, tried "
                             "again), failed (the job failed)", ["kind", "result"], registry=r)
        self.finished = Counter("cellstream_job_runs", "Job runs here that ended, by how: done, failed, paused, "
                                "cancelled, lease_lost", ["kind", "state"], registry=r)
        self.running = Gauge("cellstream_job_running", "Jobs this process runs now", ["kind"], registry=r)
        self.throttled = Counter("cellstream_job_throttled_seconds", "Time steps spent waiting on their throttle, "
                                 "by reason: rate (the rate and the pause), lag (a replica lags), latency (a node's "
                                 "writes are slow)", ["kind", "reason"], registry=r)
        self.replica_lag = Gauge("cellstream_job_probed_replica_lag_seconds", "A replica's lag as the last probe of "
                                 "a job's throttle found it (+Inf: it does not replicate)", ["node", "replica"],
                                 registry=r)
        self.write_latency = Gauge("cellstream_job_probed_write_latency_seconds", "A node's heartbeat write as the "
                                   "last probe of a job's throttle timed it", ["node"], registry=r)
        self.node_down = Gauge("cellstream_job_probed_node_down", "1 while the last probe of a job's throttle found "
                               "the node down", ["node"], registry=r)

    def observe_load(self, load: NodeLoad) -> None:
        """Export a probe's answer (:class:`~logstore.jobs.load.LoadGuard`'s ``on_probe``)."""
        self.node_down.labels(load.node).set(1 if load.down else 0)
        if load.latency_ms is not None:
            self.write_latency.labels(load.node).set(load.latency_ms / 1000)
        for replica in load.replicas:
            if replica.seconds is not None:
                self.replica_lag.labels(load.node, replica.replica).set(replica.seconds)
            else:  # unknown (it did not answer): no series rather than its last value
                with contextlib.suppress(KeyError):
                    self.replica_lag.remove(load.node, replica.replica)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def watch(self, jobs: JobStore) -> None:
        """Export the state of every job of ``jobs``'s store too (:class:`JobRecordsCollector`)."""
        self.registry.register(JobRecordsCollector(jobs))


class JobRecordsCollector(Collector):
    """At each scrape, the jobs of a store as their records have them (one read of the jobs shard's news):

    - ``cellstream_jobs{kind, state}``: jobs by state;
    - ``cellstream_job_failed{job_id, kind}``: 1 for each failed job (until it is resumed or cancelled);
    - ``cellstream_job_lease_lapsed_seconds{job_id, kind}``: for each job waiting for a runner (planned,
      running or cancelling with no live owner), how long it has waited;
    - ``cellstream_job_progress_ratio{job_id, kind}``: units done / units in all, for each job not over;
    - ``cellstream_job_backoff_seconds{job_id, kind, reason}``: for each job backing off on a node's load
      (reason ``lag`` or ``latency``), for how long.
    """

    def __init__(self, jobs: JobStore) -> None:
        self.jobs = jobs

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # unchecked: the families are made at each collect

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            records = self.jobs.jobs()
        except LogstoreError as exc:  # the store is down: the scrape's other metrics say so, keep them
            logger.warning("jobs metrics: cannot read the job records: %s", exc)
            return
        at = now()
        counts = GaugeMetricFamily("cellstream_jobs", "Jobs of the store by kind and state", labels=["kind", "state"])
        failed = GaugeMetricFamily("cellstream_job_failed", "1 for each failed job of the store (until resumed or "
                                   "cancelled)", labels=["job_id", "kind"])
        lapsed = GaugeMetricFamily("cellstream_job_lease_lapsed_seconds", "How long a job has waited for a runner "
                                   "(no owner, or its lease ran out)", labels=["job_id", "kind"])
        ratio = GaugeMetricFamily("cellstream_job_progress_ratio", "Units done over units in all, of each job not "
                                  "over", labels=["job_id", "kind"])
        backoff = GaugeMetricFamily("cellstream_job_backoff_seconds", "How long a job has been backing off on the load "
                                    "of a node (reason: lag, latency)", labels=["job_id", "kind", "reason"])
        by_state: dict[tuple[str, str], int] = {}
        for record in records:
            by_state[(record.kind, record.state)] = by_state.get((record.kind, record.state), 0) + 1
            if record.state == "failed":
                failed.add_metric([record.id, record.kind], 1)
            if record.claimable(at):
                since = record.lease_expires or record.updated_at
                lapsed.add_metric([record.id, record.kind], max(0.0, (at - since).total_seconds()))
            total = record.total
            if record.state not in FINAL_STATES and total:
                ratio.add_metric([record.id, record.kind], record.done / total)
            if record.backoff is not None and record.state == "running" and not record.lease_lapsed(at):
                backoff.add_metric([record.id, record.kind, record.backoff.cause],
                                   max(0.0, (at - record.backoff.since).total_seconds()))
        for kind in sorted({r.kind for r in records}):
            for state in JOB_STATES:
                counts.add_metric([kind, state], by_state.get((kind, state), 0))
        yield from (counts, failed, lapsed, ratio, backoff)
