"""Issue 51's "Done when", end to end on 3 MariaDB nodes, one with a replica: a store grows, shrinks and splits
while 4 writers write, a `cellstream tail` process publishes to Kafka and a `cellstream run` app keeps a
secondary index; neither process is restarted, both follow the shard map.

The scenario: nodes a (replicated to the replica server) and b; node c joins; `shards rebalance --apply`
runs in a process SIGKILLed after some shards are done and the next `shards rebalance --apply` resumes and
finishes it; then b is drained and removed and a split into a new node d, writers going on. After each part:
every acknowledged cell is in exactly one node's log, once, with its added_id (and node a's replica holds
what a holds); the tailer delivered every cell to Kafka, each shard's in added_id order; the app handled
every cell, its offsets reached every shard's last cell and its index holds exactly what the cells say
(queries by driver, the brute-force expectation); `cellstream index verify` exits 0 with no stray rows.

The job's process is killed in the middle of a move (its copy held back by a throttle changed while it
runs). What tests/logstore/test_rebalance.py proves on plain nodes (the plan's balance, cancel, the split's
halves, the refusals) is not repeated here; its helpers are used.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from indexer.indexes.applier import Index, lag
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from logstore.backends.mysql.moves import PendingMove, pending_moves
from logstore.jobs import JobRecord, JobStore
from logstore.registry import url_password, without_password
from tests.harness import REPO
from tests.harness.index_support import SEED_YAML, actual, expected, seed, trip
from tests.harness.kafka_support import assert_shard_order, wait_for
from tests.harness.shared_servers import KAFKA
from tests.logstore.test_rebalance import Writers, check_whole, node_cells

SHARDS = 256  # the smallest count that gives a job enough moves to be killed among them; the benchmark runs 4096
PARTITIONS = 4
NAME = "driver_partner_index"
DRIVERS = [uuid.UUID(int=(0xD1 << 120) | n) for n in range(40)]  # entries spread over 40 index shards
CITIES = [uuid.UUID(int=(0xC1 << 120) | n) for n in range(3)]
APP_NAME = "grow"  # the app's offsets are the consumer app.grow's
DEADLINE = 60.0  # seconds any wait below may take before the test fails


def wait_until(check: Callable[[], Any], what: str, timeout: float = DEADLINE,
               why: Callable[[], str] = str) -> Any:
    """Poll ``check`` until it returns something true (returned), failing after ``timeout`` seconds with
    ``what`` and what ``why()`` says."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what} {why()}"
        time.sleep(0.05)
    return found


class TripWriters(Writers):
    """test_rebalance's writer threads, writing trips the index keeps: new rows, and new versions of the
    writer's own earlier rows under another driver (their entries move between index shards). Paced, so
    that the tailer and the app keep up."""

    def _write(self, cluster: Path, i: int) -> None:
        rnd = random.Random(i)
        rows: list[tuple[uuid.UUID, int]] = []  # this writer's rows and their last ref_key
        try:
            with logstore.open(cluster, map_refresh=0.5) as store:
                n = 0
                while not self._stop.is_set():
                    batch = [(key, "BASE", 1, trip(rnd.choice(DRIVERS), rnd.choice(CITIES), n, fare=n))
                             for key in (uuid.uuid4() for _ in range(7))]
                    for at in rnd.sample(range(len(rows)), min(3, len(rows))):
                        key, ref = rows[at]
                        rows[at] = (key, ref + 1)
                        batch.append((key, "BASE", ref + 1, trip(rnd.choice(DRIVERS), rnd.choice(CITIES), n)))
                    cells = store.put_cells(batch)
                    rows.extend((key, 1) for key, _, ref, _ in batch if ref == 1)
                    with self._lock:
                        self.acknowledged.extend(cells)
                    n += 1
                    self._stop.wait(0.1)  # pacing, not synchronization
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)


class Consumers:
    """The `cellstream tail` process publishing BASE to Kafka (offsets in ZooKeeper) and the
    `cellstream run` process of tests/harness/grow_app.py, both on the cluster file, each logging to a file."""

    def __init__(self, tmp: Path, cluster: Path, zk: str, prefix: str) -> None:
        self.app_log = tmp / "handled.txt"
        self.app_log.touch()
        index = tmp / "indexes.yaml"
        index.write_text(SEED_YAML)
        env = {**os.environ, "PYTHONPATH": str(REPO), "GROW_NAME": APP_NAME, "GROW_STORE": str(cluster),
               "GROW_INDEX": str(index), "GROW_LOG": str(self.app_log)}
        commands = {
            "tailer": ["tail", "--store", str(cluster), "--brokers", KAFKA, "--zookeeper", zk, "--name", "grow",
                       "--prefix", prefix, "--partitions", str(PARTITIONS), "--columns", "BASE"],
            "app": ["run", str(REPO / "tests" / "harness" / "grow_app.py") + ":app"],
        }
        self.logs = {name: tmp / f"{name}.log" for name in commands}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name, argv in commands.items():
            with open(self.logs[name], "wb") as out:
                self.procs[name] = subprocess.Popen([sys.executable, "-m", "cellstream", *argv], env=env, cwd=tmp,
                                                    stdout=out, stderr=subprocess.STDOUT)

    def check_alive(self) -> None:
        """Both processes still the ones started (never restarted, never died)."""
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"the {name} exited {proc.returncode}: {self.tail(name)}"

    def tail(self, name: str) -> str:
        """The end of a process's log, for a failure's message."""
        return f"\n{name}'s log ends:\n{self.logs[name].read_text()[-3000:]}"

    def handled(self) -> set[tuple[int, int]]:
        """(shard, added_id) of every cell the app's trigger handled."""
        return {(int(s), int(a)) for s, a in (line.split() for line in self.app_log.read_text().splitlines())}

    def stop(self) -> dict[str, int | None]:
        """SIGTERM both, as an operator stops them; their exit codes."""
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


@pytest.fixture
def consumers(tmp_path: Path) -> Iterator[list[Consumers]]:
    started: list[Consumers] = []
    yield started
    for running in started:
        running.stop()


def cluster_file(path: Path, urls: dict[str, str], replica: str) -> Path:
    """Nodes a (with its replica) and b, splitting the shards in halves."""
    half = SHARDS // 2
    path.write_text(f'shards = {SHARDS}\n'
                    f'[[nodes]]\nname = "a"\nurl = "{urls["a"]}"\nshards = "0-{half - 1}"\nreplicas = ["{replica}"]\n'
                    f'[[nodes]]\nname = "b"\nurl = "{urls["b"]}"\nshards = "{half}-{SHARDS - 1}"\n')
    return path


def check_replica(primary: str, replica: str) -> None:
    """Node a's replica holds exactly a's cells, added_ids included (moves in and drops out replicated)."""
    want = sorted(node_cells({"a": primary}, "a")["a"])
    wait_until(lambda: sorted(node_cells({"a": replica}, "a")["a"]) == want, "node a's replica to hold a's cells")


def check_consumers(store: logstore.Store, cluster: Path, cells: list[logstore.Cell], prefix: str,
                    running: Consumers, capsys: pytest.CaptureFixture[str]) -> None:
    """What the tailer and the app did with ``cells`` (every BASE cell of the store), and the index."""
    running.check_alive()
    ids = {(c.shard, c.added_id) for c in cells}
    # The tailer: every cell on Kafka; each shard's first deliveries in added_id order (replays may repeat).
    messages = wait_for(KAFKA, f"{prefix}.BASE", ids, timeout=DEADLINE)
    assert_shard_order(messages, PARTITIONS)
    # The app: every cell handled; its offsets, read where the map puts each shard, past the shard's last cell,
    # all held by its one process; the index applied to the end of every shard's log.
    wait_until(lambda: ids <= running.handled(), "the app to handle every cell", why=lambda: running.tail("app"))
    last: dict[int, int] = {}
    for shard, added_id in ids:
        last[shard] = max(last.get(shard, 0), added_id)

    def offsets_at_the_end() -> bool:
        offsets = store.read_offsets(f"app.{APP_NAME}")
        return all(shard in offsets and (offsets[shard].location or 0) >= at for shard, at in last.items())
    wait_until(offsets_at_the_end, "the app's offsets to reach every shard's last cell",
               why=lambda: running.tail("app"))
    owners = {record.owner for record in store.read_offsets(f"app.{APP_NAME}").values()}
    assert len(owners) == 1 and f".{running.procs['app'].pid}." in owners.pop()
    definition = seed()
    wait_until(lambda: lag(store, definition)[0] == 0, "the index to be applied to every shard's end",
               why=lambda: running.tail("app"))
    want = expected(store, definition)
    assert len(want) == len({c.row_key for c in cells})
    assert actual(store, definition) == want
    index = Index(store, NAME)
    by_driver: dict[str, set[uuid.UUID]] = {}
    for row, (_, fields) in want.items():
        by_driver.setdefault(str(fields["driver_partner_uuid"]), set()).add(row)
    for driver in DRIVERS:
        found = [e.row_key for e in index.query(driver_partner_uuid=driver, limit=100_000)]
        assert len(found) == len(set(found)) and set(found) == by_driver.get(str(driver), set()), driver
    capsys.readouterr()
    code = main(["index", "verify", NAME, "--store", str(cluster), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["mismatches"] == {} and report["strays"] == [] and report["pending"] == 0
    assert report["rows"] == len(want)


def test_the_store_grows_shrinks_and_splits_under_writers_a_tailer_and_an_index_app(
        replicated_database: tuple[str, str], mysql_database_factory: Callable[[], str], zk_chroot: str,
        topic_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, consumers: list[Consumers],
        capsys: pytest.CaptureFixture[str]) -> None:
    primary, replica = replicated_database
    urls = {"a": primary, **{name: mysql_database_factory() for name in "bcd"}}
    monkeypatch.setenv("CST_NODE_PW", url_password(urls["c"]) or "")
    cluster = cluster_file(tmp_path / "cluster.toml", urls, replica)
    store_arg = ["--store", str(cluster)]
    with logstore.open(cluster, map_refresh=0.5) as store:
        rnd = random.Random(51)
        seeded = store.put_cells([(uuid.uuid4(), "BASE", 1, trip(rnd.choice(DRIVERS), rnd.choice(CITIES), n))
                                  for n in range(2000)])
        running = Consumers(tmp_path, cluster, zk_chroot, topic_prefix)
        consumers.append(running)
        # The app registers the index when it starts; built and made the one queries read, as an operator would.
        def kept() -> bool:
            record = IndexCatalog(store).find(NAME)
            return record is not None and record.version(1).live_since is not None
        wait_until(kept, "the app to keep its index current")
        backfill(store, NAME, 1)
        IndexCatalog(store).activate(NAME, 1)
        jobs = JobStore(store)

        # -- 1. node c joins; a rebalance under writers, its process SIGKILLed after some moves, resumed --------
        writers = TripWriters(cluster)
        try:
            assert main(["nodes", "add", "c", without_password(urls["c"]), "--password-env", "CST_NODE_PW",
                         *store_arg]) == 0
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            log = tmp_path / "rebalance.log"  # a file, not a pipe: a full pipe would block the job's logging
            with open(log, "wb") as out:
                first = subprocess.Popen([sys.executable, "-m", "cellstream", "shards", "rebalance", "--apply",
                                          "--rate", "40", "--concurrency", "2", *store_arg],
                                         env=env, stdout=subprocess.DEVNULL, stderr=out)
            try:
                def some_moved() -> list[JobRecord]:
                    assert first.poll() is None, log.read_text()[-3000:]
                    return [j for j in jobs.jobs() if j.kind == "rebalance" and _moved(j) >= 10]
                [job] = wait_until(some_moved, "the rebalance job to move 10 shards")
                # Killed in the middle of a move: its copy held back (the throttle changed while the job runs),
                # so that the move is half done when the SIGKILL comes, whenever that is.
                assert main(["jobs", "throttle", job.id, "--rate", "1", *store_arg]) == 0

                def copying() -> list[PendingMove]:
                    assert first.poll() is None, log.read_text()[-3000:]
                    store.refresh_map()
                    return [m for m in pending_moves(store) if m.phase == "copying"]
                wait_until(copying, "a move of the job to wait in its copy", why=lambda: str(jobs.get(job.id)))
            finally:
                first.kill()
                first.wait()
            job = jobs.get(job.id)
            assert job.state == "running" and job.steps[0].state == "running", "killed with moves left"
            assert pending_moves(store), "killed in the middle of a move"
            killed_at = _moved(job)
            assert main(["jobs", "throttle", job.id, "--unlimited", *store_arg]) == 0
            capsys.readouterr()
            assert main(["shards", "rebalance", "--apply", *store_arg, "--json"]) == 0
            assert "is unfinished: resuming it" in capsys.readouterr().err
        finally:
            acknowledged = writers.stop()
        [final] = [j for j in jobs.jobs() if j.kind == "rebalance"]
        assert final.id == job.id and final.state == "done" and [s.state for s in final.steps] == ["done", "done"]
        assert _moved(final) > killed_at
        store.refresh_map()
        placement = store.placement()
        moves = final.params["moves"]
        astray = {m["shard"]: final.steps[0].cursor["shards"].get(str(m["shard"])) for m in moves
                  if placement[m["shard"]] != m["target"]}
        assert not astray, astray
        assert Counter(m["target"] for m in moves)["c"] >= SHARDS // 5 and set(placement) == {"a", "b", "c"}
        assert not pending_moves(store)
        assert len(acknowledged) > 500
        cells = seeded + acknowledged
        check_whole(store, urls, cells)
        check_replica(primary, replica)
        check_consumers(store, cluster, cells, topic_prefix, running, capsys)

        # -- 2. b drained and removed, a split into a new node d: writers go on ------------------------------
        writers = TripWriters(cluster)
        try:
            assert main(["nodes", "drain", "b", "--concurrency", "4", *store_arg]) == 0
            assert main(["nodes", "remove", "b", *store_arg]) == 0
            assert main(["nodes", "add", "d", without_password(urls["d"]), "--password-env", "CST_NODE_PW",
                         *store_arg]) == 0
            assert main(["nodes", "split", "a", "--into", "d", "--concurrency", "4", *store_arg]) == 0
        finally:
            more = writers.stop()
        store.refresh_map()
        placement = store.placement()
        done = [j for j in jobs.jobs() if j.kind == "rebalance"]
        assert [j.state for j in done] == ["done"] * 3, done
        split = done[-1].params["moves"]  # the last job's (listed oldest first)
        assert split and all(placement[m["shard"]] == "d" for m in split)
        assert set(placement) == {"a", "c", "d"} and store.nodes == ["a", "c", "d"] and not pending_moves(store)
        assert len(more) > 200
        cells += more
        check_whole(store, urls, cells)
        check_replica(primary, replica)
        check_consumers(store, cluster, cells, topic_prefix, running, capsys)
    assert running.stop() == {"tailer": 0, "app": 0}


def _moved(job: Any) -> int:
    """The shards a rebalance job's cursor says are moved."""
    cursor = job.steps[0].cursor if isinstance(job.steps[0].cursor, dict) else {}
    return sum(1 for found in cursor.get("shards", {}).values() if found.get("state") == "done")
