"""A job's back-off on the load of the nodes it touches (logstore.jobs.load, logstore.backends.mysql.heartbeat),
on real MariaDB with its real replica: a job waits while the replica lags (its SQL thread held back, or stopped)
and goes on when it catches up, says why in its record, its ``cellstream jobs show`` and its metrics; the
maximums change while it runs (``cellstream jobs throttle ID --max-lag S --max-latency MS``); a node that is down
is reported, not waited for; nodes without a probe (SQLite, worker nodes) are never a reason to wait."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import logstore
from cellstream.cli.main import main
from logstore.backends.http.recorder import HttpRecorder
from logstore.backends.mysql.recorder import MySQLRecorder
from logstore.errors import NodeDownError
from logstore.jobs import (
    Backoff,
    JobRecord,
    JobRunner,
    JobStore,
    KindRegistry,
    LoadGuard,
    NodeLoad,
    RunnerConfig,
    ThrottleSettings,
)
from logstore.jobs.load import ProbedRecorder
from logstore.jobs.throttle import Throttle
from tests.harness.faults import TcpProxy
from tests.harness.shared_servers import MYSQL_REPLICA, mysql_admin
from tests.logstore.copy_job import CopyKind
from tests.logstore.test_jobs import InThread, fill
from tests.logstore.test_replication import caught_up

SHARDS = 8  # as tests.logstore.test_jobs.fill's keys
CONFIG = RunnerConfig(lease_seconds=3.0, poll_seconds=0.05, progress_seconds=0.2, backoff_seconds=0.05,
                      load_probe_seconds=0.05, load_probe_timeout=2.0)
REPLICA = "{0.hostname}:{0.port}".format(urlsplit(MYSQL_REPLICA))


class GuardedCopy(CopyKind):
    """The job tests' copy kind, whose every chunk touches every node of the store (it writes there)."""

    def load_nodes(self, record: JobRecord) -> list[str]:
        return self.store.nodes


@contextlib.contextmanager
def replica_stopped() -> Iterator[None]:
    """The shared replica stops applying (``STOP SLAVE SQL_THREAD``); it applies again after, whatever happens
    (other tests share it)."""
    admin = mysql_admin(MYSQL_REPLICA)
    try:
        with admin.cursor() as cur:
            cur.execute("STOP SLAVE SQL_THREAD")
        yield
    finally:
        with admin.cursor() as cur:
            cur.execute("START SLAVE SQL_THREAD")
        admin.close()


@contextlib.contextmanager
def replica_lagging(database: str) -> Iterator[None]:
    """The shared replica lags from here: a transaction of ours holds the lock of this host's heartbeat row
    there, so its SQL thread waits to apply the next heartbeat, and everything after it (as when it is
    stopped; but another test session starting, whose server harness runs START SLAVE, cannot undo this).
    The replica goes on at the end, whatever happens."""
    admin = mysql_admin(MYSQL_REPLICA)
    try:
        with admin.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute(f"SELECT ts FROM `{database}`.cellstream_heartbeat WHERE writer = %s FOR UPDATE",
                        (socket.gethostname(),))
            assert cur.fetchone() is not None
        yield
    finally:
        with admin.cursor() as cur:
            cur.execute("ROLLBACK")
        admin.close()


@pytest.fixture
def replicated(replicated_database: tuple[str, str], tmp_path: Path) -> tuple[Path, str, str]:
    """A cluster file of one node, ``a``, with the real replica; the node created and replicated."""
    primary, replica = replicated_database
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'shards = {SHARDS}\n[[nodes]]\nname = "a"\nshards = "0-{SHARDS - 1}"\nurl = "{primary}"\n'
                       f'replicas = ["{replica}"]\n')
    with logstore.open(cluster):
        pass
    caught_up(primary, replica)
    return cluster, primary, replica


def wait_for(what: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return found


def database_of(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def backoff_of(store: logstore.Store, job_id: str) -> Backoff | None:
    return JobStore(store).get(job_id).backoff


def cli(store: str | Path, *args: str, as_json: bool = True) -> tuple[int, Any]:
    out = _Capture()
    with contextlib.redirect_stdout(out):
        code = main(["--store", str(store), "jobs", *args, *(["--json"] if as_json else [])])
    text = out.getvalue()
    return code, (json.loads(text) if as_json and text.strip() else text)


class _Capture:
    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> int:
        self._parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def getvalue(self) -> str:
        return "".join(self._parts)


def warm(store: logstore.Store, primary: str, replica: str) -> None:
    """One probe, so the heartbeat table and this host's row are on the replica before it is stopped."""
    guard = LoadGuard(store, store.nodes)
    try:
        assert guard.check(ThrottleSettings(max_latency_ms=None)) is None
    finally:
        guard.close()
    caught_up(primary, replica)


# -- replica lag -----------------------------------------------------------------------------------------------
def test_a_job_backs_off_while_a_replica_lags_and_goes_on_once_it_caught_up(
        replicated: tuple[Path, str, str]) -> None:
    cluster, primary, replica = replicated
    with logstore.open(cluster) as store:
        fill(store, 0, 300)
        warm(store, primary, replica)
        kind = GuardedCopy(store)
        runner = JobRunner(store, KindRegistry([kind]), CONFIG)
        runner.metrics.watch(runner.jobs)
        value = runner.metrics.registry.get_sample_value
        # 100 cells a second: 3 seconds for the 300 if nothing held it back.
        job = runner.submit("copy", {"shards": [0], "chunk": 5},
                            throttle=ThrottleSettings(rate=100, max_lag_seconds=0.3, max_latency_ms=None))
        with replica_lagging(database_of(primary)):
            running = InThread(runner, job.id)
            held = wait_for(lambda: backoff_of(store, job.id))
            assert held.cause == "lag" and held.node == "a" and held.subject == f"replica {REPLICA} of node a"
            assert re.fullmatch(rf"replica {re.escape(REPLICA)} of node a lags \d+\.\d+ s > 0\.3 s", held.detail)
            copied = kind.copied
            assert 0 < copied < 300
            time.sleep(1.0)
            assert kind.copied == copied  # not a chunk while the replica lags
            code, shown = cli(cluster, "show", job.id, as_json=False)
            assert code == 0 and f"throttled since {held.since.isoformat(timespec='seconds')}: replica {REPLICA} " \
                                  "of node a lags" in shown and "max lag 0.3 s, max latency off" in shown
            assert (value("cellstream_job_backoff_seconds", {"job_id": job.id, "kind": "copy", "reason": "lag"})
                    or 0) > 0
            assert (value("cellstream_job_probed_replica_lag_seconds", {"node": "a", "replica": REPLICA}) or 0) > 0.3
        final = running.result(timeout=30)
    assert final.state == "done" and final.done == 300 and kind.copied == 300 and final.backoff is None
    assert (value("cellstream_job_throttled_seconds_total", {"kind": "copy", "reason": "lag"}) or 0) >= 1.0
    assert value("cellstream_job_backoff_seconds", {"job_id": job.id, "kind": "copy", "reason": "lag"}) is None


def test_the_maximum_lag_changed_while_the_job_runs_takes_effect(replicated: tuple[Path, str, str]) -> None:
    cluster, primary, replica = replicated
    with logstore.open(cluster) as store:
        fill(store, 0, 300)
        warm(store, primary, replica)
        kind = GuardedCopy(store)
        runner = JobRunner(store, KindRegistry([kind]), CONFIG)
        job = runner.submit("copy", {"shards": [0], "chunk": 5},
                            throttle=ThrottleSettings(rate=100, max_lag_seconds=600, max_latency_ms=None))
        with replica_lagging(database_of(primary)):
            running = InThread(runner, job.id)
            wait_for(lambda: kind.copied >= 20)
            assert backoff_of(store, job.id) is None  # lagging, but by less than 600 s
            code, changed = cli(cluster, "throttle", job.id, "--max-lag", "0.3")
            assert code == 0 and changed["state"] == "running"
            held = wait_for(lambda: backoff_of(store, job.id))
            assert held.cause == "lag" and held.detail.endswith("> 0.3 s") and kind.copied < 300
            code, changed = cli(cluster, "throttle", job.id, "--max-lag", "off")
            assert code == 0
            final = running.result(timeout=30)  # done while the replica still lags
            assert final.state == "done" and final.done == 300 and final.throttle.max_lag_seconds is None
        assert cli(cluster, "throttle", job.id, "--max-lag", "0")[0] == 2  # a maximum is above 0


def test_a_replica_whose_heartbeat_cannot_be_read_answers_with_its_replication_status(
        replicated: tuple[Path, str, str]) -> None:
    cluster, primary, replica = replicated
    loads: list[NodeLoad] = []
    with logstore.open(cluster) as store, contextlib.closing(
            LoadGuard(store, ["a"], interval=0.01, on_probe=loads.append)) as guard:
        settings = ThrottleSettings(max_lag_seconds=1.0, max_latency_ms=None)
        with replica_stopped():  # before the heartbeat table is created: the replica will not have it
            pressure = guard.check(settings)
            assert pressure is not None and pressure.cause == "lag"
            assert pressure.detail.startswith(f"replica {REPLICA} of node a does not replicate (Seconds_Behind_Master "
                                              "is NULL")
            stopped = loads[-1].replicas[0]
            assert stopped.source == "seconds_behind_master"
        caught_up(primary, replica)
        wait_for(lambda: guard.check(settings) is None)
        applying = loads[-1].replicas[0]
        assert applying.source == "heartbeat" and (applying.seconds or 0) < 1.0


# -- write latency ---------------------------------------------------------------------------------------------
def test_a_node_whose_writes_are_slower_than_the_maximum_holds_the_job_back(mysql_database: str) -> None:
    with logstore.open(mysql_database, shards=SHARDS) as store:
        fill(store, 0, 60)
        kind = GuardedCopy(store)
        runner = JobRunner(store, KindRegistry([kind]), CONFIG)
        job = runner.submit("copy", {"shards": [0], "chunk": 5},
                            throttle=ThrottleSettings(max_latency_ms=0.001))  # no write is that quick
        running = InThread(runner, job.id)
        held = wait_for(lambda: backoff_of(store, job.id))
        [node] = store.nodes
        assert held.cause == "latency" and held.subject == f"node {node}"
        assert re.fullmatch(rf"node {node} write latency \d+ ms > 0\.001 ms", held.detail)
        assert kind.copied == 5  # the first chunk, then the back-off
        assert cli(mysql_database, "throttle", job.id, "--max-latency", "off")[0] == 0
        final = running.result(timeout=30)
        assert final.state == "done" and final.done == 60 and final.backoff is None
        value = runner.metrics.registry.get_sample_value
        assert (value("cellstream_job_throttled_seconds_total", {"kind": "copy", "reason": "latency"}) or 0) > 0
        assert (value("cellstream_job_probed_write_latency_seconds", {"node": node}) or 0) > 0


def test_a_node_is_probed_at_most_once_an_interval_whatever_the_chunks(mysql_database: str) -> None:
    loads: list[NodeLoad] = []
    with logstore.open(mysql_database, shards=SHARDS) as store, contextlib.closing(
            LoadGuard(store, store.nodes, interval=3600, on_probe=loads.append)) as guard:
        throttle = Throttle(ThrottleSettings(), guard=guard)

        def chunks() -> None:
            for _ in range(20):
                throttle.wait(1)
        threads = [threading.Thread(target=chunks) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(loads) == 1 and loads[0].latency_ms is not None and loads[0].down is None


# -- a node down -------------------------------------------------------------------------------------------------
def test_a_node_that_is_down_is_reported_not_waited_for(mysql_database: str) -> None:
    parts = urlsplit(mysql_database)
    with TcpProxy(parts.hostname or "", parts.port or 3306) as proxy:
        url = mysql_database.replace(f":{parts.port}/", f":{proxy.port}/")
        with logstore.open(url, shards=SHARDS, connect_timeout=1.0, read_timeout=2.0) as store, contextlib.closing(
                LoadGuard(store, store.nodes, interval=0.01, timeout=1.0, down_recheck=0.05)) as guard:
            [node] = store.nodes
            settings = ThrottleSettings()
            assert guard.check(settings) is None and guard.down() == {}
            proxy.cut()
            pressure = wait_for(lambda: guard.check(settings))  # at the next probe: the last is up to 0.01 s old
            assert pressure is not None and pressure.cause == "down" and pressure.node == node
            assert list(guard.down()) == [node]
            throttle = Throttle(settings, guard=guard)
            with pytest.raises(NodeDownError) as caught:
                throttle.wait(1)
            assert caught.value.node == node and caught.value.retriable and f"node {node} is down" in str(caught.value)
            assert throttle.backoff is None
            proxy.restore()
            wait_for(lambda: guard.check(settings) is None)
            throttle.wait(1)


# -- stores without replicas or probes ---------------------------------------------------------------------------
def test_sqlite_and_worker_node_stores_never_hold_a_job_back(sqlite_url: str) -> None:
    assert issubclass(MySQLRecorder, ProbedRecorder) and not issubclass(HttpRecorder, ProbedRecorder)
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        fill(store, 0, 30)
        strict = ThrottleSettings(max_lag_seconds=0.001, max_latency_ms=0.001)
        with contextlib.closing(LoadGuard(store, store.nodes)) as guard:
            assert guard.check(strict) is None and guard.down() == {}
        kind = GuardedCopy(store)
        runner = JobRunner(store, KindRegistry([kind]), CONFIG)
        job = runner.submit("copy", {"shards": [0], "chunk": 5}, throttle=strict)
        final = runner.run(job.id)
        assert final.state == "done" and final.done == 30
        value = runner.metrics.registry.get_sample_value
        assert value("cellstream_job_throttled_seconds_total", {"kind": "copy", "reason": "latency"}) is None
