"""Prometheus metrics of a tailer worker (prometheus-client), one registry per worker."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class TailerMetrics:
    """The worker's metrics; ``serve(port)`` exposes them on ``/metrics``."""

    def __init__(self, name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.name = name
        r = self.registry
        self.lag_cells = Gauge("cellstream_tailer_lag_cells", "Cells of the shard after its acknowledged position",
                               ["tailer", "shard"], registry=r)
        self.lag_seconds = Gauge("cellstream_tailer_lag_seconds",
                                 "Age of the oldest cell of the shard not yet acknowledged by Kafka",
                                 ["tailer", "shard"], registry=r)
        self.published = Counter("cellstream_tailer_published", "Cells acknowledged by the sink",
                                 ["tailer"], registry=r)
        self.deadlettered = Counter("cellstream_tailer_deadlettered", "Cells sent to the dead-letter topic",
                                    ["tailer"], registry=r)
        self.delivery_failures = Counter("cellstream_tailer_delivery_failures",
                                         "Deliveries that failed and were resent", ["tailer"], registry=r)
        self.commits = Counter("cellstream_tailer_commits", "Shard offsets committed", ["tailer"], registry=r)
        self.owned_shards = Gauge("cellstream_tailer_owned_shards", "Shards this worker publishes",
                                  ["tailer"], registry=r)
        self.leader = Gauge("cellstream_tailer_leader", "1 while this worker is the leader", ["tailer"], registry=r)
        self.lease_valid = Gauge("cellstream_tailer_lease_valid",
                                 "1 while this worker may publish (its ZooKeeper lease holds)", ["tailer"],
                                 registry=r)

    def forget_shard(self, shard: int) -> None:
        for gauge in (self.lag_cells, self.lag_seconds):
            with contextlib.suppress(KeyError):
                gauge.remove(self.name, str(shard))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
