"""The dashboard and the alert rules read only series the code exports, and the dashboard is a whole
Grafana dashboard. (`make lint` runs promtool on the rules: their syntax and their unit tests.)"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

import logstore
from cellstream.console.server import ConsoleMetrics
from connectors.migration.facade import MigrationReadMetrics
from connectors.migration.mover import MoveMetrics
from indexer.runtime.metrics import AppMetrics
from logstore.jobs import JobMetrics, JobStore
from logstore.mirror import MirrorMetrics
from logstore.node.server import _Metrics as WorkerMetrics
from tailer.metrics import TailerMetrics

MONITORING = Path(__file__).resolve().parents[2] / "docker" / "monitoring"
SERIES = re.compile(r"\bcellstream_[a-z_]+\b")


def exported() -> set[str]:
    """Every series name the metrics classes of the tailer, apps, the worker node, the console and jobs (their
    runners', and their records' as read from a store) expose."""
    jobs = JobMetrics()
    registries = [TailerMetrics("t").registry, AppMetrics("a").registry, WorkerMetrics(CollectorRegistry()).registry,
                  ConsoleMetrics(CollectorRegistry()).registry, jobs.registry, MirrorMetrics().registry,
                  MigrationReadMetrics().registry, MoveMetrics().registry]
    names: set[str] = set()
    with tempfile.TemporaryDirectory() as directory, logstore.open(f"sqlite:///{directory}/store", shards=4) as store:
        jobs.watch(JobStore(store))
        for registry in registries:
            for family in registry.collect():
                suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                            "info": ("_info",)}.get(family.type, ("",))
                names.update(family.name + suffix for suffix in suffixes)
    return names


def expressions() -> dict[str, str]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    found = {f"alert {r['alert']}": r["expr"] for group in rules["groups"] for r in group["rules"]}
    dashboard = json.loads((MONITORING / "cellstream-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found[f"variable {variable['name']}"] = variable["query"]["query"]
    return found


def test_every_series_the_dashboard_and_the_alerts_read_is_exported() -> None:
    names = exported()
    assert "cellstream_tailer_published_total" in names and "cellstream_app_handler_seconds_bucket" in names
    unknown = {where: sorted(set(SERIES.findall(expr)) - names) for where, expr in expressions().items()}
    assert {where: missing for where, missing in unknown.items() if missing} == {}


def test_the_alerts_cover_what_an_operator_is_woken_for() -> None:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"][0]["rules"]
    by_name = {r["alert"]: r for r in rules}
    for name in ("CellstreamHandlerStalled", "CellstreamTailerLagGrowing", "CellstreamDeadLettersGrowing",
                 "CellstreamTailerLeaseLost", "CellstreamWorkerNodeNotReady", "CellstreamJobFailed",
                 "CellstreamJobWithoutRunner", "CellstreamMirrorLagging", "CellstreamMirrorStalled",
                 "CellstreamMigrationReadsMismatching", "CellstreamMigrationCaptureLagging"):
        rule = by_name[name]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
        assert rule.get("for"), f"{name} fires on one scrape"


def test_the_dashboard_has_a_section_per_component_and_every_panel_a_query() -> None:
    dashboard = json.loads((MONITORING / "cellstream-dashboard.json").read_text())
    assert dashboard["uid"] == "cellstream-overview" and dashboard["schemaVersion"] >= 36
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Tailers", "Apps and connectors", "Secondary indexes", "Worker nodes", "Dead-letter console",
                    "Jobs", "Standby mirror", "Migrations"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, panel["title"]
