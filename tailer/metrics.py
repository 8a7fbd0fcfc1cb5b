"""Prometheus metrics of a tailer worker (prometheus-client), one registry per worker.

Lag is exported as totals over the owned shards and as series for the few most
lagging shards: a series per shard (4096 shards, two gauges each) costs the worker and
the Prometheus server for every owned shard, lagging or not, so it is opt-in
(:meth:`TailerMetrics.enable_per_shard`, ``per_shard_metrics`` in the config).
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from logstore.build_info import register_build_info

Lag = tuple[int, float]  # (cells after the acknowledged position, age in seconds of the oldest of them)


class TailerMetrics:
    """The worker's metrics; ``serve(port)`` exposes them on ``/metrics``."""

    def __init__(self, name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.name = name
        r = self.registry
        if registry is None:
            register_build_info(r, "tailer")
        self.lag_cells = Gauge("cellstream_tailer_lag_cells",
                               "Cells after the acknowledged positions, summed over the owned shards",
                               ["tailer"], registry=r)
        self.lag_seconds = Gauge("cellstream_tailer_lag_seconds",
                                 "Age of the oldest cell not yet acknowledged, over the owned shards",
                                 ["tailer"], registry=r)
        self.lagging_shards = Gauge("cellstream_tailer_lagging_shards",
                                    "Owned shards with cells not yet acknowledged", ["tailer"], registry=r)
        self.top_lag_cells = Gauge("cellstream_tailer_top_lag_cells",
                                   "Cells after the acknowledged position, for each of the most lagging shards",
                                   ["tailer", "shard"], registry=r)
        self.top_lag_seconds = Gauge("cellstream_tailer_top_lag_seconds",
                                     "Age of the oldest cell not yet acknowledged, for each of the most lagging "
                                     "shards", ["tailer", "shard"], registry=r)
        self.shard_lag_cells: Gauge | None = None
        self.shard_lag_seconds: Gauge | None = None
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
        self._top: set[int] = set()
        self._lagging: set[int] = set()  # shards whose per-shard series were last set above zero

    @property
    def per_shard(self) -> bool:
        return self.shard_lag_cells is not None

    def enable_per_shard(self) -> None:
        """Export the lag of every owned shard too. Safe twice (a registry takes a name once)."""
        if self.shard_lag_cells is not None:
            return
        self.shard_lag_cells = Gauge("cellstream_tailer_shard_lag_cells",
                                     "Cells of the shard after its acknowledged position", ["tailer", "shard"],
                                     registry=self.registry)
        self.shard_lag_seconds = Gauge("cellstream_tailer_shard_lag_seconds",
                                       "Age of the oldest cell of the shard not yet acknowledged",
                                       ["tailer", "shard"], registry=self.registry)

    def add_shards(self, shards: Iterable[int]) -> None:
        """Shards this worker now owns: with per-shard series, each shows from the start (at zero)."""
        if self.shard_lag_cells is not None and self.shard_lag_seconds is not None:
            for shard in shards:
                self.shard_lag_cells.labels(self.name, str(shard)).set(0)
                self.shard_lag_seconds.labels(self.name, str(shard)).set(0)

    def forget_shards(self, shards: Iterable[int]) -> None:
        """:meth:`forget_shard` of each (a worker stopping: without per-shard series, no pass over its shards)."""
        if self._top or self.shard_lag_cells is not None:
            for shard in shards:
                self.forget_shard(shard)

    def forget_shard(self, shard: int) -> None:
        if shard not in self._top and self.shard_lag_cells is None:  # the common case: nothing to remove
            return
        gauges = [self.top_lag_cells, self.top_lag_seconds] if shard in self._top else []
        if self.shard_lag_cells is not None and self.shard_lag_seconds is not None:
            gauges += [self.shard_lag_cells, self.shard_lag_seconds]
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(self.name, str(shard))
        self._top.discard(shard)
        self._lagging.discard(shard)

    def record_lag(self, lags: Mapping[int, Lag], top: int) -> None:
        """Set the gauges from one measurement: ``lags`` holds every owned shard that lags (the
        others lag by nothing), so the work follows the lagging shards, not the owned ones."""
        self.lag_cells.labels(self.name).set(sum(cells for cells, _ in lags.values()))
        self.lag_seconds.labels(self.name).set(max((seconds for _, seconds in lags.values()), default=0.0))
        self.lagging_shards.labels(self.name).set(len(lags))
        leaders = {shard for shard, _ in heapq.nlargest(top, lags.items(), key=lambda item: item[1])}
        for shard in self._top - leaders:
            for gauge in (self.top_lag_cells, self.top_lag_seconds):
                with contextlib.suppress(KeyError):
                    gauge.remove(self.name, str(shard))
        for shard in leaders:
            cells, seconds = lags[shard]
            self.top_lag_cells.labels(self.name, str(shard)).set(cells)
            self.top_lag_seconds.labels(self.name, str(shard)).set(seconds)
        self._top = leaders
        if self.shard_lag_cells is not None and self.shard_lag_seconds is not None:
            for shard in self._lagging - lags.keys():
                self.shard_lag_cells.labels(self.name, str(shard)).set(0)
                self.shard_lag_seconds.labels(self.name, str(shard)).set(0)
            for shard, (cells, seconds) in lags.items():
                self.shard_lag_cells.labels(self.name, str(shard)).set(cells)
                self.shard_lag_seconds.labels(self.name, str(shard)).set(seconds)
            self._lagging = set(lags)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
