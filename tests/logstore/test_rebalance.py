"""Rebalancing as a job on real MariaDB nodes (logstore.rebalance; `cellstream shards rebalance --apply`, `nodes
drain`, `nodes split`): a node joins and takes its share under writers, the job's process SIGKILLed mid-job and
resumed by the next command; every acknowledged cell ends in exactly one node's log, exactly once, with its
added_id; a cancel leaves every shard whole on one node; drain, remove and split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest

import logstore
from cellstream.cli.main import main
from logstore.backends.mysql.moves import pending_moves
from logstore.jobs import JobStore
from logstore.nodes import add_node
from logstore.registry import url_password, without_password
from tests.harness import REPO
from tests.harness.stores import two_nodes

SHARDS = 256  # enough moves to kill a job among them; the benchmark runs 4096


@pytest.fixture
def grown(mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, str]]:
    """A cluster file of nodes a and b holding cells, node c joined empty; each node's URL (with password)."""
    urls = {name: mysql_database_factory() for name in "abcd"}
    monkeypatch.setenv("CST_NODE_PW", url_password(urls["c"]) or "")
    cluster = two_nodes(tmp_path / "cluster.toml", [urls["a"], urls["b"]], SHARDS)
    with logstore.open(cluster) as store:
        store.put_cells([(uuid.uuid4(), "seed", 1, {"i": i}) for i in range(3000)])
        add_node(store, "c", without_password(urls["c"]), password_env="CST_NODE_PW")
    return cluster, urls


def node_cells(urls: dict[str, str], names: str | None = None) -> dict[str, list[tuple[int, int, bytes, str, int]]]:
    """Every cell row of each node's database (of ``names``, default all): (shard, added_id, row_key, column,
    ref_key)."""
    out: dict[str, list[tuple[int, int, bytes, str, int]]] = {}
    for name in names or urls:
        parts = urlsplit(urls[name])
        try:
            conn = pymysql.connect(host=parts.hostname, port=parts.port or 3306, user=parts.username,
                                   password=parts.password or "", database=parts.path.lstrip("/"))
        except pymysql.err.OperationalError:  # a node never created
            out[name] = []
            continue
        try:
            with conn.cursor() as cur:
                try:
                    cur.execute("SELECT shard, added_id, row_key, column_name, ref_key FROM cells")
                except pymysql.err.ProgrammingError:
                    out[name] = []
                    continue
                out[name] = [(int(r[0]), int(r[1]), bytes(r[2]), str(r[3]), int(r[4])) for r in cur.fetchall()]
        finally:
            conn.close()
    return out


def check_whole(store: logstore.Store, urls: dict[str, str], acknowledged: list[logstore.Cell]) -> None:
    """Every acknowledged cell in exactly one node's log, once, with its added_id, on the node holding its
    shard; no cell of a shard on any other node (the source copies dropped)."""
    rows = node_cells(urls)
    placement = store.placement()
    where: dict[tuple[bytes, str, int], list[tuple[str, int, int]]] = {}
    for name, held in rows.items():
        for shard, added_id, row_key, column, ref_key in held:
            assert placement[shard] == name, f"shard {shard}'s cells on {name}, the map says {placement[shard]}"
            where.setdefault((row_key, column, ref_key), []).append((name, shard, added_id))
    for cell in acknowledged:
        found = where.get((cell.row_key.bytes, cell.column, cell.ref_key), [])
        assert len(found) == 1, f"{cell.row_key}/{cell.column}/{cell.ref_key} found {len(found)} times"
        assert found[0][1:] == (cell.shard, cell.added_id)
    for name, held in rows.items():
        per_shard = Counter((shard, added_id) for shard, added_id, *_ in held)
        assert max(per_shard.values(), default=1) == 1, f"an added_id twice on {name}"


class Writers:
    """Threads writing batches through their own stores until stopped; what each was acknowledged."""

    def __init__(self, cluster: Path, n: int = 4) -> None:
        self.acknowledged: list[logstore.Cell] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._write, args=(cluster, i)) for i in range(n)]
        for thread in self._threads:
            thread.start()

    def _write(self, cluster: Path, i: int) -> None:
        try:
            with logstore.open(cluster, map_refresh=0.5) as store:
                n = 0
                while not self._stop.is_set():
                    cells = store.put_cells([(uuid.uuid4(), "w", n, {"writer": i, "n": n}) for _ in range(20)])
                    with self._lock:
                        self.acknowledged.extend(cells)
                    n += 1
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    def stop(self) -> list[logstore.Cell]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        assert not self.errors, self.errors
        return self.acknowledged


def seed_cells(store: logstore.Store) -> list[logstore.Cell]:
    out = []
    for shard in range(SHARDS):
        location = 0
        while page := store.get_cells_for_shard(shard, location, 1000, columns=["seed"])[0]:
            out.extend(page)
            location = page[-1].added_id
    return out


def test_a_joined_node_takes_its_share_while_writers_go_on_through_a_sigkill(
        grown: tuple[Path, dict[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    cluster, urls = grown
    with logstore.open(cluster) as store:
        seeded = seed_cells(store)
        jobs = JobStore(store)
        writers = Writers(cluster)
        try:
            # The first run is killed mid-job: slowed down, so that it is killed with moves left.
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            log = cluster.with_name("rebalance.log")
            with log.open("wb") as stderr:  # a file, not a pipe nobody reads while it runs
                first = subprocess.Popen([sys.executable, "-m", "cellstream", "shards", "rebalance", "--apply",
                                          "--rate", "400", "--concurrency", "2", "--store", str(cluster)],
                                         env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            try:
                deadline = time.monotonic() + 60
                while not any(j.kind == "rebalance" and j.done >= 300 for j in jobs.jobs()):
                    assert first.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, "the job did not get going"
                    time.sleep(0.05)
            finally:
                first.kill()
                first.wait()
            [job] = [j for j in jobs.jobs() if j.kind == "rebalance"]
            assert job.state == "running" and job.steps[0].state == "running"
            assert main(["jobs", "throttle", job.id, "--unlimited", "--store", str(cluster)]) == 0
            # The next rebalance resumes it (its owner is gone) rather than planning another.
            assert main(["shards", "rebalance", "--apply", "--store", str(cluster), "--json"]) == 0
            assert "is unfinished: resuming it" in capsys.readouterr().err
        finally:
            acknowledged = writers.stop()
        [final] = [j for j in jobs.jobs() if j.kind == "rebalance"]
        assert final.id == job.id and final.state == "done"
        assert [s.state for s in final.steps] == ["done", "done"]
        store.refresh_map()
        held = Counter(store.placement())
        assert set(held) == {"a", "b", "c"} and held["c"] >= SHARDS // 4, held
        assert not pending_moves(store)
        check_whole(store, urls, seeded + acknowledged)
        assert len(acknowledged) > 100


def test_cancel_stops_after_the_moves_under_way(grown: tuple[Path, dict[str, str]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cluster, _ = grown
    with logstore.open(cluster) as store:
        seeded = seed_cells(store)
        assert main(["shards", "rebalance", "--apply", "--detach", "--rate", "300", "--store", str(cluster),
                     "--json"]) == 0
        job_id = json.loads(capsys.readouterr().out)["id"]
        jobs = JobStore(store)
        result: list[int] = []
        runner = threading.Thread(target=lambda: result.append(
            main(["jobs", "resume", job_id, "--run", "--store", str(cluster)])))
        runner.start()
        deadline = time.monotonic() + 60
        while jobs.get(job_id).done < 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert main(["jobs", "cancel", job_id, "--store", str(cluster)]) == 0
        runner.join(60)
        assert result == [9] and jobs.get(job_id).state == "cancelled"
        store.refresh_map()
        assert not pending_moves(store), "a move was left half done"
        moved = Counter(store.placement())["c"]
        assert 0 < moved < SHARDS // 3
        # The source copies of the moves done stay (the drop step did not run): readable, not counted twice.
        assert [store.get_cell(c.row_key, "seed", 1) for c in seeded] == seeded


def test_drain_remove_and_split(grown: tuple[Path, dict[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    cluster, urls = grown
    store_arg = ["--store", str(cluster)]
    with logstore.open(cluster) as store:
        seeded = seed_cells(store)
        assert main(["nodes", "drain", "b", *store_arg]) == 0
        store.refresh_map()
        assert "b" not in store.placement()
        assert main(["nodes", "remove", "b", *store_arg]) == 0
        store.refresh_map()
        assert store.nodes == ["a", "c"]
        check_whole(store, urls, seeded)
        capsys.readouterr()
        add_node(store, "d", without_password(urls["d"]), password_env="CST_NODE_PW")
        before = Counter(store.placement())["a"]
        assert main(["nodes", "split", "a", "--into", "d", *store_arg]) == 0
        store.refresh_map()
        after = Counter(store.placement())
        assert abs(after["a"] - after["d"]) <= before // 5 and after["a"] + after["d"] == before
        check_whole(store, urls, seeded)
        assert main(["nodes", "split", "a", "--into", "d", *store_arg]) == 2
        assert "holds shards already" in capsys.readouterr().err


def test_a_node_down_holds_up_only_the_moves_that_touch_it(mysql_database_factory: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from logstore.balance import Move
    from logstore.jobs import JobRunner, KindRegistry, RunnerConfig
    from logstore.rebalance import Planned, Rebalance, job_params
    from logstore.retry import RetryPolicy
    from tests.harness.private_mariadb import PrivateMariaDB

    urls = {"a": mysql_database_factory(), "b": mysql_database_factory()}
    cluster = two_nodes(tmp_path / "cluster.toml", [urls["a"], urls["b"]], SHARDS)
    with PrivateMariaDB(tmp_path / "node-c") as server:
        urls["c"] = server.url("cells")
        monkeypatch.setenv("CST_NODE_PW", url_password(urls["c"]) or "")
        quick = RetryPolicy(initial=0.05, maximum=0.2, deadline=2.0)
        with logstore.open(cluster, retry=quick, connect_timeout=1.0, read_timeout=5.0) as store:
            store.put_cells([(uuid.uuid4(), "seed", 1, {"i": i}) for i in range(1500)])
            seeded = seed_cells(store)
            add_node(store, "c", without_password(urls["c"]), password_env="CST_NODE_PW")
            # a drained half to b, half to c
            planned = Planned([Move(s, "a", "bc"[n % 2], 0) for n, s in enumerate(range(SHARDS // 2))], {}, {})
            to_c = {m.shard for m in planned.moves if m.target == "c"}
            kind = Rebalance(store)
            runner = JobRunner(store, KindRegistry([kind]), RunnerConfig(lease_seconds=5, poll_seconds=0.1,
                                                                         progress_seconds=0.2))
            job = runner.submit("rebalance", job_params(planned, "drain a", wait_for_nodes=300))
            server.stop()
            result: list[Any] = []
            thread = threading.Thread(target=lambda: result.append(runner.run(job.id)))
            thread.start()
            jobs = JobStore(store)

            def states() -> dict[str, str]:
                cursor = jobs.get(job.id).steps[0].cursor or {}
                return {k: v["state"] for k, v in cursor.get("shards", {}).items()}
            deadline = time.monotonic() + 120
            # Every move to b is done while c is down; those to c wait, and the job says why.
            while not (all(states().get(str(m.shard)) == "done" for m in planned.moves if m.target == "b")
                       and all(states().get(str(s)) == "waiting" for s in to_c)):
                assert thread.is_alive() and time.monotonic() < deadline, states()
                time.sleep(0.1)
            assert any(line.startswith("node c does not answer") for line in kind.details(jobs.get(job.id)))
            assert jobs.get(job.id).state == "running"
            server.start()
            thread.join(180)
            assert result and result[0].state == "done", result
            store.refresh_map()
            assert "a" not in store.placement() and {store.node_of(s) for s in to_c} == {"c"}
            check_whole(store, urls, seeded)
