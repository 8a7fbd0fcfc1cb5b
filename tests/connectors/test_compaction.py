"""Compaction of the Parquet lake (`cellstream connect compact`, a job): small files of closed partitions merged
into target-sized ones with every row kept once, as DuckDB reads them; readers never count a row twice or
miss one while it runs; a file committed meanwhile stays; a compaction SIGKILLed mid-way resumes as a job."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pytest

import logstore
from cellstream.cli.main import main
from connectors import compaction
from logstore.jobs import JobRunner, JobStore, KindRegistry, RunnerConfig
from tests.harness import REPO

SHARDS = 16
CONFIG = """
name: lake
columns: [BASE, FARE]
checkpoint_interval: 0.05
sink:
  type: parquet
  root: lake
"""
FUTURE = "2099-01-01"  # the cells are written today: compact the partitions of days before this one


def rows(root: Path, column: str) -> list[dict[str, Any]]:
    with duckdb.connect() as con:
        result = con.execute(f"SELECT * FROM read_parquet('{root}/{column}/date=*/*.parquet', "
                             "hive_partitioning=true, union_by_name=true) ORDER BY shard, added_id")
        names = [d[0] for d in result.description]
        return [dict(zip(names, row, strict=True)) for row in result.fetchall()]


def files(root: Path, column: str) -> list[Path]:
    return sorted((root / column).glob("date=*/*.parquet"))


def load(store_url: str, config: Path, store: logstore.Store, n: int, body: Any = None) -> None:
    """n cells of each column written, then loaded by one `connect run --drain` (one checkpoint's files)."""
    store.put_cells([(uuid.uuid4(), column, 1, body(i) if body else {"n": i}) for i in range(n)
                     for column in ("BASE", "FARE")])
    assert main(["connect", "run", str(config), "--drain", "--store", store_url, "--json"]) == 0


@pytest.fixture
def lake(tmp_path: Path, sqlite_url: str) -> Any:
    config = tmp_path / "sink.yaml"
    config.write_text(CONFIG)
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        yield config, store, tmp_path / "lake"


def test_small_files_become_one_and_every_row_stays_with_the_widened_types(
        lake: Any, sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    config, store, root = lake
    for run in range(6):  # fare an int at first, a float later; code an int, then a string (a conflict)
        load(sqlite_url, config, store, 30, lambda i, run=run: {
            "n": i, "fare": i * 1.5 if run >= 3 else i, "code": f"A{i}" if run == 5 else i})
    capsys.readouterr()
    before = {column: rows(root, column) for column in ("BASE", "FARE")}
    assert [len(files(root, c)) for c in ("BASE", "FARE")] == [6, 6]
    assert main(["connect", "compact", str(config), "--store", sqlite_url, "--json"]) == 0  # today is open
    assert json.loads(capsys.readouterr().out) == {"id": None, "kind": "compact", "state": "done", "steps": 0}
    assert [len(files(root, c)) for c in ("BASE", "FARE")] == [6, 6]
    assert main(["connect", "compact", str(config), "--before", FUTURE, "--store", sqlite_url, "--json"]) == 0
    job = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert job["state"] == "done" and job["done"] == 12 and job["unit"] == "files"
    assert [len(files(root, c)) for c in ("BASE", "FARE")] == [1, 1]
    for column in ("BASE", "FARE"):
        after = rows(root, column)
        assert len(after) == 180 and [(r["shard"], r["added_id"]) for r in after] == [
            (r["shard"], r["added_id"]) for r in before[column]]
        assert [r["fare"] for r in after] == [float(r["fare"]) for r in before[column]]
        assert [r["code"] for r in after] == [r["code"] for r in before[column]]
    [record] = JobStore(store).jobs()
    assert record.state == "done" and [s.name for s in record.steps] == [
        f"{c}/{files(root, c)[0].parent.name}" for c in ("BASE", "FARE")]
    assert main(["connect", "status", str(config), "--store", sqlite_url, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["sink"]["files"] == 2 and status["sink"]["last_commit"]["partitions_compacted"] == 1


def test_readers_never_see_a_row_twice_or_miss_one(lake: Any, sqlite_url: str) -> None:
    """A reader counts the rows and the distinct positions over and over while loads add small files and
    compactions merge them: a count never drops and never holds a position twice."""
    config, store, root = lake
    load(sqlite_url, config, store, 20)
    stop, seen, failures = threading.Event(), [], []

    def read() -> None:
        while not stop.is_set():
            try:
                with duckdb.connect() as con:
                    [(n, distinct)] = con.execute(
                        f"SELECT count(*), count(DISTINCT (shard, added_id)) FROM read_parquet("
                        f"'{root}/BASE/date=*/*.parquet')").fetchall()
            except duckdb.Error as exc:  # a file listed before a swap and opened after it: read again
                failures.append(str(exc))
                continue
            seen.append((n, distinct))
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(6):
            for _ in range(3):
                load(sqlite_url, config, store, 20)
            assert main(["connect", "compact", str(config), "--before", FUTURE, "--store", sqlite_url,
                         "--json"]) == 0
    finally:
        stop.set()
        reader.join(30)
    assert len(seen) > 20, "the reader hardly read: the test did not test"
    assert all(n == distinct for n, distinct in seen), "a row was seen twice"
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen)), "rows went missing"
    assert seen[-1][0] == 20 * 19 and len(files(root, "BASE")) == 1


def test_a_file_committed_while_the_partition_is_compacted_stays(lake: Any, sqlite_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config, store, root = lake
    for _ in range(3):
        load(sqlite_url, config, store, 10)
    real = compaction._merge

    def merge_then_a_load_commits(*args: Any) -> Any:
        merged = real(*args)
        if not getattr(merge_then_a_load_commits, "done", False):
            merge_then_a_load_commits.done = True  # type: ignore[attr-defined]
            load(sqlite_url, config, store, 10)  # a late shard's cells land in the partition being merged
        return merged
    monkeypatch.setattr(compaction, "_merge", merge_then_a_load_commits)
    assert main(["connect", "compact", str(config), "--before", FUTURE, "--store", sqlite_url]) == 0
    for column in ("BASE", "FARE"):
        got = [(r["shard"], r["added_id"]) for r in rows(root, column)]
        assert len(got) == len(set(got)) == 40
    assert len(files(root, "BASE")) == 2  # the merged file, and the one committed meanwhile


SCRIPT = """
import sys
import logstore
from connectors.compaction import LakeCompaction, compaction_params
from logstore.jobs import JobRunner, KindRegistry, RunnerConfig, ThrottleSettings
from pathlib import Path
store = logstore.open(sys.argv[1])
runner = JobRunner(store, KindRegistry([LakeCompaction()]), RunnerConfig(lease_seconds=1, progress_seconds=0))
params = compaction_params(Path(sys.argv[2]), before=__import__("datetime").date(2099, 1, 1))
record = runner.submit("compact", params, throttle=ThrottleSettings(rate=8))
print(record.id, flush=True)
runner.run(record.id)
"""


def test_a_compaction_sigkilled_mid_way_resumes_and_the_lake_stays_exact(lake: Any, sqlite_url: str) -> None:
    config, store, root = lake
    for _ in range(8):
        load(sqlite_url, config, store, 10)
    expected = {column: [(r["shard"], r["added_id"]) for r in rows(root, column)] for column in ("BASE", "FARE")}
    worker = subprocess.Popen([sys.executable, "-c", SCRIPT, sqlite_url, str(config)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    try:
        assert worker.stdout is not None
        job_id = worker.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while JobStore(store).get(job_id).steps[0].state != "done":  # BASE merged, FARE under way
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
    record = JobStore(store).get(job_id)
    assert record.state == "running" and record.steps[1].state != "done"
    for column in ("BASE", "FARE"):  # between the two steps the lake is whole
        assert [(r["shard"], r["added_id"]) for r in rows(root, column)] == expected[column]
    time.sleep(1.2)  # the dead runner's lease runs out
    final = JobRunner(store, KindRegistry([compaction.LakeCompaction()]), RunnerConfig(lease_seconds=1)).run(job_id)
    assert final.state == "done"
    for column in ("BASE", "FARE"):
        assert [(r["shard"], r["added_id"]) for r in rows(root, column)] == expected[column]
        assert len(files(root, column)) == 1
    assert not list((root / "_staging").iterdir()), "the dead runner's staging folder stayed"


def test_at_4096_shards_files_follow_the_data_not_the_shard_count(tmp_path: Path) -> None:
    """100,000 cells in batches of 1,000 while a connector checkpoints every second: at most one file per
    column and day partition per checkpoint; after compaction, one."""
    url = f"sqlite:///{tmp_path / 'store'}"
    config = tmp_path / "sink.yaml"
    config.write_text(CONFIG.replace("columns: [BASE, FARE]", "columns: [BASE]").replace(
        "checkpoint_interval: 0.05", "checkpoint_interval: 1"))
    root = tmp_path / "lake"
    with logstore.open(url, shards=4096) as store:
        worker = subprocess.Popen([sys.executable, "-m", "cellstream", "connect", "run", str(config), "--store", url],
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL)
        try:
            for batch in range(100):
                store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": batch * 1000 + i, "city": f"c{i % 7}"})
                                 for i in range(1000)])
            deadline = time.monotonic() + 120
            while True:
                offsets = store.read_offsets("app.lake")
                at = {shard: (offsets[shard].location or 0) if shard in offsets else 0 for shard in range(4096)}
                if not sum(store.counts_after(at, columns=["BASE"]).values()):
                    break
                assert worker.poll() is None and time.monotonic() < deadline, "the connector fell behind"
                time.sleep(0.2)
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(60) == 0
        from connectors.sinks.commits import LOG_DIR, CommitRecord, read_state

        # The records since the last state file (the log keeps no more): one file a partition each.
        records = [CommitRecord.model_validate_json(p.read_bytes()) for p in (root / LOG_DIR).glob("0*[0-9].json")]
        assert records and all(len({Path(f.path).parent for f in r.add}) == len(r.add) for r in records)
        commits = read_state(root).seq
        assert len(rows(root, "BASE")) == 100_000 and len(files(root, "BASE")) <= commits < 150
        assert main(["connect", "compact", str(config), "--before", FUTURE, "--store", url, "--json"]) == 0
        partitions = {f.parent for f in files(root, "BASE")}
        assert len(files(root, "BASE")) == len(partitions) <= 2  # one a day (two when run across midnight)
        assert len(rows(root, "BASE")) == 100_000


def test_two_compactions_of_one_partition_never_hold_a_row_twice(lake: Any, sqlite_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner whose lease lapsed mid-step while another took the job over: the one that commits second
    finds its inputs merged away and commits nothing."""
    from connectors.errors import SinkUnavailableError

    config, store, root = lake
    for _ in range(3):
        load(sqlite_url, config, store, 10)
    real = compaction._merge
    raced: list[BaseException] = []

    def merge_then_another_compaction_commits(*args: Any) -> Any:
        merged = real(*args)
        if not raced:
            raced.append(RuntimeError("the other one ran"))
            monkeypatch.setattr(compaction, "_merge", real)
            assert main(["connect", "compact", str(config), "--before", FUTURE, "--store", sqlite_url]) == 0
        return merged
    monkeypatch.setattr(compaction, "_merge", merge_then_another_compaction_commits)
    runner = JobRunner(store, KindRegistry([compaction.LakeCompaction()]), RunnerConfig(step_attempts=1))
    job = runner.submit("compact", compaction.compaction_params(config, before=dt.date(2099, 1, 1)))
    final = runner.run(job.id)
    assert final.state == "failed" and "merged by another compaction" in (final.error or "")
    assert issubclass(compaction.CompactionRaceError, SinkUnavailableError)  # retriable: run again, re-planned
    for column in ("BASE", "FARE"):
        got = [(r["shard"], r["added_id"]) for r in rows(root, column)]
        assert len(got) == len(set(got)) == 30
