"""`cellstream connect` with the Parquet lake, from the logstore (direct mode): a load and its resumption,
flush-before-commit while cells arrive, SIGKILL mid-load then a restart, a poison cell to the DLQ,
and a bad file. The lake is read back with DuckDB."""

from __future__ import annotations

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
from connectors.config import load_connector
from connectors.runtime import connector_app
from indexer.runtime.dlq_store import DeadLetterStore
from tests.harness import REPO

SHARDS = 8
CONFIG = """
name: lake
columns: [BASE, FARE]
checkpoint_interval: {interval}
sink:
  type: parquet
  root: lake
  max_rows: {rows}
"""


def write_config(tmp_path: Path, interval: float = 0.1, rows: int = 100_000) -> Path:
    path = tmp_path / "sink.yaml"
    path.write_text(CONFIG.format(interval=interval, rows=rows))
    return path


def lake(root: Path, column: str) -> list[tuple[int, int, str]]:
    """(shard, added_id, row_key) of every row of the column's lake, sorted; [] when there is none yet."""
    if not list((root / column).glob("date=*/*.parquet")):
        return []
    with duckdb.connect() as con:
        return sorted(con.execute(
            f"SELECT shard, added_id, row_key FROM read_parquet('{root}/{column}/date=*/*.parquet', "
            "hive_partitioning=true, union_by_name=true)").fetchall())


def source(store: logstore.Store, column: str) -> list[tuple[int, int, str]]:
    out = []
    for shard in range(SHARDS):
        location = 0
        while cells := store.get_cells_for_shard(shard, location, 1000, columns=[column])[0]:
            out.extend((c.shard, c.added_id, str(c.row_key)) for c in cells)
            location = cells[-1].added_id
    return sorted(out)


def trips(store: logstore.Store, n: int) -> None:
    store.put_cells([(uuid.uuid4(), column, 1, {"n": i, "city": f"c{i % 5}", "fare": {"total": i * 1.5}})
                     for i in range(n) for column in ("BASE", "FARE", "OTHER")])


def test_a_load_then_a_resumed_one_give_the_source_exactly(sqlite_url: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path)
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        trips(store, 200)

        def connect(*argv: str) -> tuple[int, list[dict[str, Any]]]:
            code = main(["connect", *argv, str(config), "--store", sqlite_url, "--json"])
            text = capsys.readouterr().out.strip()
            return code, [json.loads(line) for line in text.splitlines()] if text else []

        code, [first] = connect("run", "--drain")
        assert code == 0 and first["processed"] == 400 and first["dead_lettered"] == 0
        for column in ("BASE", "FARE"):
            assert lake(tmp_path / "lake", column) == source(store, column)
        assert not (tmp_path / "lake" / "OTHER").exists()
        code, [status] = connect("status")
        assert code == 0 and status["lag_cells"] == 0 and status["shards_committed"] == SHARDS
        assert status["sink"]["files"] == len(list((tmp_path / "lake").glob("*/date=*/*.parquet")))
        assert status["sink"]["last_commit"]["rows"] > 0 and "shards" not in status
        trips(store, 50)
        code, [lagging] = connect("status", "--shards")
        assert lagging["lag_cells"] == sum(row["lag_cells"] for row in lagging["shards"]) == 100
        code, [second] = connect("run", "--drain")
        assert code == 0 and second["processed"] == 100
        for column in ("BASE", "FARE"):
            assert lake(tmp_path / "lake", column) == source(store, column)
        with duckdb.connect() as con:
            [(fare,)] = con.execute(f"SELECT max(\"fare.total\") FROM read_parquet('{tmp_path}/lake/FARE/date=*/"
                                    "*.parquet', hive_partitioning=true, union_by_name=true)").fetchall()
        assert fare == 199 * 1.5


def test_committed_positions_never_pass_what_the_lake_holds(sqlite_url: str, tmp_path: Path) -> None:
    """Flush-before-commit: read the committed positions, then the lake; every cell up to a committed
    position is there, while cells keep arriving and checkpoints keep happening."""
    config = load_connector(write_config(tmp_path, interval=0.05))
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        app, _ = connector_app(config, store)
        stop = threading.Event()

        def serve() -> None:
            import asyncio

            async def until() -> None:
                event = asyncio.Event()
                task = asyncio.create_task(app.run_async(event))
                while not stop.is_set():
                    await asyncio.sleep(0.02)
                event.set()
                await task
            asyncio.run(until())
        thread = threading.Thread(target=serve)
        thread.start()
        checks = 0
        try:
            for _ in range(40):
                trips(store, 20)
                committed = {s: r.location for s, r in store.read_offsets("app.lake").items() if r.location}
                held = {(s, a) for column in ("BASE", "FARE") for s, a, _ in lake(tmp_path / "lake", column)}
                due = [(s, a) for column in ("BASE", "FARE") for s, a, _ in source(store, column)
                       if a <= committed.get(s, 0)]
                assert set(due) <= held, "a committed position passed cells the lake does not hold"
                checks += len(due)
                time.sleep(0.02)
        finally:
            stop.set()
            thread.join(60)
            app.close()
        assert checks > 0, "nothing was committed: the test did not test"
        for column in ("BASE", "FARE"):  # the stop checkpointed what it had
            assert lake(tmp_path / "lake", column) == source(store, column)


def test_sigkilled_three_times_while_cells_are_written_the_lake_equals_the_source(
        sqlite_url: str, tmp_path: Path) -> None:
    """Each kill comes once the lake holds rows whose positions the store's offsets do not have yet (the
    sink's commit is ahead of the source's): the restarted connector must skip exactly those."""
    config = write_config(tmp_path, interval=0.05, rows=40)  # rotations and checkpoints all the time
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        trips(store, 3000)
        writing = threading.Event()
        writing.set()

        def write() -> None:
            while writing.is_set():
                trips(store, 50)
                time.sleep(0.02)
        writer = threading.Thread(target=write)
        writer.start()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        ahead = 0
        try:
            for _ in range(3):
                worker = subprocess.Popen([sys.executable, "-m", "cellstream", "connect", "run", str(config),
                                           "--store", sqlite_url], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
                try:
                    deadline = time.monotonic() + 60
                    while True:
                        assert worker.poll() is None and time.monotonic() < deadline, "that moment never came"
                        committed = {s: r.location or 0 for s, r in store.read_offsets("app.lake").items()}
                        try:
                            held = lake(tmp_path / "lake", "BASE") + lake(tmp_path / "lake", "FARE")
                        except duckdb.Error:  # a file renamed in while DuckDB listed them
                            continue
                        if any(a > committed.get(s, 0) for s, a, _ in held):
                            ahead += 1
                            break
                        time.sleep(0.01)
                finally:
                    worker.send_signal(signal.SIGKILL)
                    worker.wait(30)
        finally:
            writing.clear()
            writer.join(30)
        assert ahead == 3
        assert main(["connect", "run", str(config), "--drain", "--store", sqlite_url, "--json"]) == 0
        for column in ("BASE", "FARE"):
            assert lake(tmp_path / "lake", column) == source(store, column)


def test_a_poison_cell_goes_to_the_dead_letter_queue(sqlite_url: str, tmp_path: Path) -> None:
    config = load_connector(write_config(tmp_path))
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        trips(store, 10)
        bad = store.put_cell(uuid.uuid4(), "BASE", 1, {"row_key": "mine", "n": 1})
        app, _ = connector_app(config, store)
        with app:
            counts = app.drain(timeout=60)
        assert counts.dead_lettered == 1 and counts.processed == 20
        [entry] = DeadLetterStore(store, "lake").entries()
        assert entry.cell["row_key"] == str(bad.row_key) and "collides with the cell's own column" in entry.message
        assert entry.handler == "sink:parquet:BASE" and entry.body == bad.body
        assert str(bad.row_key) not in {k for _, _, k in lake(tmp_path / "lake", "BASE")}
        assert len(lake(tmp_path / "lake", "BASE")) == 10


def test_a_bad_file_is_one_clear_line(sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logstore.open(sqlite_url, shards=SHARDS).close()  # the store exists: the file is what is wrong
    path = tmp_path / "sink.yaml"
    path.write_text("name: lake\ncolumns: [BASE]\nsink:\n  type: parquet\n  root: lake\n  max_rows: 0\n")
    assert main(["connect", "run", str(path), "--drain", "--store", sqlite_url]) == 4  # a configuration file
    err = capsys.readouterr().err.strip()
    assert err.startswith("cellstream: error: ") and "\n" not in err
    assert "sink.yaml:6: sink.max_rows: Input should be greater than or equal to 1" in err


def test_a_lake_loaded_from_the_store_refuses_a_kafka_connector_at_start(
        sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Shard positions and Kafka offsets cannot be compared: refused at start in one line, not cell by cell
    into the dead-letter queue."""
    config = write_config(tmp_path)
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        trips(store, 10)
        assert main(["connect", "run", str(config), "--drain", "--store", sqlite_url, "--json"]) == 0
        config.write_text(config.read_text() + "brokers: 127.0.0.1:1\n")
        capsys.readouterr()
        assert main(["connect", "run", str(config), "--drain", "--store", sqlite_url]) == 4
        err = capsys.readouterr().err.strip()
        assert "holds positions of the store, this connector reads the kafka" in err and "\n" not in err
        assert not DeadLetterStore(store, "lake").entries()
