"""Direct mode distributed: the app's processes share the shards through ZooKeeper over MariaDB
(real servers, started by `make test`). Poison cells, and a worker SIGKILLed mid-handler."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import App
from logstore.retry import RetryPolicy
from tests.harness import app_worker

SHARDS = 8
WORKER = Path(app_worker.__file__)  # run as a file, in processes of their own


@pytest.fixture
def store(mysql_database: str) -> Any:
    with logstore.open(mysql_database, shards=SHARDS) as store:
        yield store


def test_poison_cells_over_mysql_with_zookeeper(store: logstore.Store, zk_chroot: str) -> None:
    cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(50)])
    handled = []
    app = App("billing", store=store, zookeeper=zk_chroot, session_timeout=4,
              backoff=RetryPolicy(initial=0.001, maximum=0.005, deadline=None))

    @app.trigger("BASE", max_attempts=3)
    def bill(cell: logstore.Cell) -> None:
        if cell.body["n"] % 10 == 0:
            raise ValueError("declined")
        handled.append((cell.shard, cell.added_id))

    assert app.drain(60) == (45, 10, 5)
    entries = app.dlq.list()
    poison = {(c.shard, c.added_id) for c in cells if c.body["n"] % 10 == 0}
    assert {(e.source["shard"], e.source["added_id"]) for e in entries} == poison
    assert all(e.attempts == 3 and e.status == "open" and e.body is not None for e in entries)
    assert set(handled) | poison == {(c.shard, c.added_id) for c in cells}  # nothing skipped
    assert app.drain(60) == (0, 0, 0)  # offsets (in ZooKeeper) moved past them


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_a_worker_sigkilled_mid_handler_its_cell_is_delivered_by_the_other(
        store: logstore.Store, mysql_database: str, zk_chroot: str, tmp_path: Path) -> None:
    cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(40)])
    hung = store.put_cell(uuid.uuid4(), "BASE", 1, {"hang": True})
    log, marker = tmp_path / "log", tmp_path / "marker"
    config = {"name": "shared", "store": mysql_database, "zookeeper": zk_chroot, "session_timeout": 4,
              "log": str(log), "marker": str(marker), "hang": True}
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(config)]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no worker reached the cell"
            time.sleep(0.05)
        time.sleep(0.2)
        victim_pid = int(marker.read_text().split()[0])
        [victim] = [p for p in procs if p.pid == victim_pid]
        [survivor] = [p for p in procs if p is not victim]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        later = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": 100 + i}) for i in range(10)])
        wanted = {(c.shard, c.added_id) for c in [*cells, *later, hung]}  # added_ids are per shard
        while not wanted <= {(int(s), int(a)) for _, s, a, _ in _lines(log)}:
            assert survivor.poll() is None and time.monotonic() < deadline + 60, "cells were never delivered"
            time.sleep(0.1)
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(60) == 0  # a graceful stop
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = _lines(log)
    assert [pid for pid, s, a, _ in lines if (int(s), int(a)) == (hung.shard, hung.added_id)] == [str(survivor.pid)]
    by_run: dict[tuple[str, int], list[int]] = defaultdict(list)
    for pid, shard, added_id, _ in lines:
        by_run[(pid, int(shard))].append(int(added_id))
    assert all(ids == sorted(ids) for ids in by_run.values())  # per-shard order in each process
