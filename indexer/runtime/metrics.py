"""Prometheus metrics of an app (prometheus-client), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from logstore.build_info import register_build_info


class AppMetrics:
    """The app's handler metrics; ``serve(port)`` exposes them (and the source's) on ``/metrics``."""

    def __init__(self, app: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        if registry is None:
            register_build_info(r, "app")
        self.app = app
        labels = ["app", "handler"]
        self.processed = Counter("cellstream_app_processed", "Cells a handler processed successfully", labels,
                                 registry=r)
        self.retried = Counter("cellstream_app_retried", "Handler attempts that failed and were retried", labels,
                               registry=r)
        self.deadlettered = Counter("cellstream_app_deadlettered", "Cells dead-lettered by a handler", labels,
                                    registry=r)
        self.dlq_open = Gauge("cellstream_app_dlq_open", "Open dead-letter entries of a handler in the store, counted "
                              "again every dlq_recount_interval", labels, registry=r)
        self.stalled = Gauge("cellstream_app_handler_stalled",
                             "1 when a handler stopped because of too many open dead letters", labels, registry=r)
        self.redrives = Counter("cellstream_app_dlq_redrives", "Dead letters the app's redrive policy handed back to "
                                "their handler, by outcome: resolved, failed (open again), skipped (changed by "
                                "another process meanwhile), error (the handler is gone)", [*labels, "outcome"],
                                registry=r)
        self.redrive_waiting = Gauge("cellstream_app_dlq_redrive_waiting", "Open dead letters the redrive policy "
                                     "will redrive (due, or after their delay), at its last look", labels, registry=r)
        self.redrive_exhausted = Gauge("cellstream_app_dlq_redrive_exhausted", "Open dead letters the redrive policy "
                                       "matches that have had all their redrives: they wait for a person", labels,
                                       registry=r)
        self.seconds = Histogram("cellstream_app_handler_seconds", "Time of one successful handler call", labels,
                                 registry=r, buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))

        index_labels = ["app", "index", "version"]
        self.index_lag_cells = Gauge("cellstream_index_lag_cells",
                                     "Cells of an index version's column not applied by live processing yet",
                                     index_labels, registry=r)
        self.index_lag_seconds = Gauge("cellstream_index_lag_seconds",
                                       "Age of the oldest cell an index version has not applied yet (0: none)",
                                       index_labels, registry=r)

        self.lag = Gauge("cellstream_app_kafka_lag", "Kafka mode: messages of an assigned partition not yet handled",
                         ["app", "topic", "partition"], registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
