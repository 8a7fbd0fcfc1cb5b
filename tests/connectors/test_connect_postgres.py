"""`cellstream connect` into a real PostgreSQL (history and latest tables, promoted typed columns), read
back with psql, the independent client: equality with the source, order-insensitivity and replays, a
poison cell to the DLQ, SIGKILL mid-load then a restart."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import logstore
from cellstream.cli.main import main
from connectors.config import load_connector
from connectors.runtime import connector_app
from indexer.runtime.dlq_store import DeadLetterStore
from tests.harness import REPO

SHARDS = 8
CONFIG = """
name: warehouse
columns: [BASE, STATUS]
checkpoint_interval: {interval}
sink:
  type: postgres
  url: {url}
  columns:
    BASE:
      mode: latest
      promote: [{{field: city, type: text}}, {{field: fare.total, type: double}}, {{field: at, type: timestamptz}}]
    STATUS: {{mode: history, promote: [{{field: done, type: boolean}}]}}
"""


def config_file(tmp_path: Path, url: str, interval: float = 0.1) -> Path:
    path = tmp_path / "warehouse.yaml"
    path.write_text(CONFIG.format(url=url, interval=interval))
    return path


def psql(url: str, query: str) -> list[list[str]]:
    """Rows as psql prints them (unaligned, | between fields)."""
    done = subprocess.run(["psql", url, "-X", "-q", "-t", "-A", "-F", "|", "-c", query], check=True,
                          capture_output=True, text=True, timeout=60)
    return [line.split("|") for line in done.stdout.splitlines() if line]


def trip(n: int) -> dict[str, object]:
    return {"city": f"c{n % 4}", "fare": {"total": n + 0.5}, "at": f"2026-11-21T10:{n % 60:02d}:00+00:00"}


def latest_of(store: logstore.Store, column: str) -> dict[str, int]:
    best: dict[str, int] = {}
    for shard in range(SHARDS):
        for cell in store.get_cells_for_shard(shard, 0, 10_000, columns=[column])[0]:
            best[str(cell.row_key)] = max(cell.ref_key, best.get(str(cell.row_key), 0))
    return best


def history_of(store: logstore.Store, column: str) -> set[tuple[str, int]]:
    return {(str(c.row_key), c.ref_key) for s in range(SHARDS)
            for c in store.get_cells_for_shard(s, 0, 10_000, columns=[column])[0]}


def test_latest_and_history_tables_equal_the_source_whatever_the_order(
        sqlite_url: str, postgres_database: str, tmp_path: Path) -> None:
    config = load_connector(config_file(tmp_path, postgres_database))
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        rows = [uuid.uuid4() for _ in range(30)]
        store.put_cells([(r, "BASE", 2, trip(i)) for i, r in enumerate(rows)])
        store.put_cells([(r, "BASE", 1, trip(100 + i)) for i, r in enumerate(rows[:10])])  # older, written later
        store.put_cells([(r, "STATUS", ref, {"done": ref == 2}) for r in rows[:12] for ref in (1, 2)])
        for _ in range(2):  # the second time from offset 0 again: a full replay changes nothing
            app, _ = connector_app(config, store)
            with app:
                assert app.drain(timeout=60).dead_lettered == 0
            store.claim_offsets("app.warehouse", "reset")
            store.commit_offsets("app.warehouse", "reset", {s: (0, {}) for s in range(SHARDS)})
        base = psql(postgres_database, "SELECT row_key, ref_key, city, \"fare_total\", pg_typeof(\"fare_total\"), "
                                       "at FROM cells_base ORDER BY row_key")
        assert {r[0]: int(r[1]) for r in base} == latest_of(store, "BASE")
        assert all(r[4] == "double precision" for r in base)
        expect = {str(r): trip(i) for i, r in enumerate(rows)}
        assert all(r[2] == expect[r[0]]["city"] and float(r[3]) == expect[r[0]]["fare"]["total"]  # type: ignore[index]
                   for r in base)
        assert base[0][5].endswith("+00")  # timestamptz
        status = psql(postgres_database, "SELECT row_key, ref_key, done, body->>'done' FROM cells_status")
        assert {(r[0], int(r[1])) for r in status} == history_of(store, "STATUS")
        assert all((r[2] == "t") == (r[3] == "true") for r in status)


def test_a_value_that_does_not_fit_its_column_goes_to_the_dlq(
        sqlite_url: str, postgres_database: str, tmp_path: Path) -> None:
    config = load_connector(config_file(tmp_path, postgres_database))
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(i)) for i in range(5)])
        bad = store.put_cell(uuid.uuid4(), "BASE", 1, {**trip(9), "fare": {"total": "free"}})
        app, _ = connector_app(config, store)
        with app:
            counts = app.drain(timeout=60)
        assert (counts.processed, counts.dead_lettered) == (5, 1)
        [entry] = DeadLetterStore(store, "warehouse").entries()
        assert entry.cell["row_key"] == str(bad.row_key) and "'fare.total' does not fit double" in entry.message
        assert psql(postgres_database, "SELECT count(*) FROM cells_base") == [["5"]]
        # Triage: the fix is in the file (fare.total as text in a new table); the entry is replayed with it.
        path = tmp_path / "warehouse.yaml"
        path.write_text(path.read_text().replace("{field: fare.total, type: double}",
                                                 "{field: fare.total, type: text}")
                        .replace("mode: latest", "mode: latest\n      table: base_v2"))
        dlq = ["dlq", "--app", str(path)]
        assert main([*dlq, "replay", entry.id, "--store", sqlite_url, "--json"]) == 0
        assert psql(postgres_database, "SELECT fare_total FROM base_v2") == [["free"]]
        assert main([*dlq, "list", "--status", "open", "--store", sqlite_url, "--json"]) == 0
        assert DeadLetterStore(store, "warehouse").entries()[0].status == "resolved"


def test_sigkill_mid_load_then_a_restart_leave_the_source_exactly(
        sqlite_url: str, postgres_database: str, tmp_path: Path) -> None:
    path = config_file(tmp_path, postgres_database, interval=0.05)
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        rows = [uuid.uuid4() for _ in range(6000)]
        store.put_cells([(r, "BASE", 1, trip(i)) for i, r in enumerate(rows)])
        store.put_cells([(r, "STATUS", 1, {"done": False}) for r in rows])
        store.put_cells([(r, "BASE", 2, trip(i + 1)) for i, r in enumerate(rows[::3])])
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        worker = subprocess.Popen([sys.executable, "-m", "cellstream", "connect", "run", str(path), "--store",
                                   sqlite_url], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not any(r.location for r in store.read_offsets("app.warehouse").values()):
                assert worker.poll() is None and time.monotonic() < deadline, "the connector never committed"
                time.sleep(0.01)
        finally:
            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
        [[loaded]] = psql(postgres_database, "SELECT count(*) FROM cells_status")
        assert 0 < int(loaded) < len(rows), loaded  # killed mid-load
        assert main(["connect", "run", str(path), "--drain", "--store", sqlite_url, "--json"]) == 0
        base = psql(postgres_database, "SELECT row_key, ref_key FROM cells_base")
        assert {r[0]: int(r[1]) for r in base} == latest_of(store, "BASE") and len(base) == len(rows)
        status = psql(postgres_database, "SELECT row_key, ref_key FROM cells_status")
        assert {(r[0], int(r[1])) for r in status} == history_of(store, "STATUS") and len(status) == len(rows)


def test_the_password_is_never_printed(sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_file(tmp_path, "postgresql://cellstream:s3cret-pw@127.0.0.1:1/nowhere")
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cell(uuid.uuid4(), "BASE", 1, trip(1))
    code = main(["connect", "run", str(path), "--drain", "--timeout", "5", "--store", sqlite_url, "--json"])
    err = capsys.readouterr().err
    assert code == 5 and err.startswith("cellstream: error: postgres sink: connecting failed")
    assert "s3cret-pw" not in err


def test_from_the_tailers_kafka_topics(sqlite_url: str, postgres_database: str, tmp_path: Path,
                                       topic_prefix: str) -> None:
    from tests.harness.kafka_support import publish
    from tests.harness.shared_servers import KAFKA

    path = config_file(tmp_path, postgres_database)
    path.write_text(path.read_text().replace("name: warehouse", f"name: {topic_prefix}-wh")
                    + f"brokers: {KAFKA}\ntopic_prefix: {topic_prefix}\n")
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        rows = [uuid.uuid4() for _ in range(40)]
        store.put_cells([(r, "BASE", 1, trip(i)) for i, r in enumerate(rows)])
        store.put_cells([(r, "BASE", 2, trip(i + 7)) for i, r in enumerate(rows[:10])])
        store.put_cells([(r, "STATUS", 1, {"done": True}) for r in rows])
        publish(store, topic_prefix)
        assert main(["connect", "run", str(path), "--drain", "--store", sqlite_url, "--json"]) == 0
        base = psql(postgres_database, "SELECT row_key, ref_key FROM cells_base")
        assert {r[0]: int(r[1]) for r in base} == latest_of(store, "BASE")
        status = psql(postgres_database, "SELECT row_key, ref_key FROM cells_status")
        assert {(r[0], int(r[1])) for r in status} == history_of(store, "STATUS")


def test_a_history_replay_falls_back_from_the_direct_copy_to_the_upsert(postgres_database: str) -> None:
    from connectors.sinks.base import Position
    from connectors.sinks.postgres import PostgresSink, PostgresSinkConfig

    start = dt.datetime(2026, 11, 22, tzinfo=dt.UTC)
    cells = [logstore.Cell(row_key=uuid.uuid4(), column="STATUS", ref_key=n % 3 + 1, body={"done": n % 2 == 0},
                           added_id=n + 1, shard=n % SHARDS, created_at=start + dt.timedelta(seconds=n))
             for n in range(40)]
    config = PostgresSinkConfig.model_validate(
        {"url": postgres_database, "columns": {"STATUS": {"mode": "history", "promote": [
            {"field": "done", "type": "boolean"}]}}})
    sink = PostgresSink(config)
    try:
        for cell in cells[:25]:
            sink.add(cell, Position(cell.shard, cell.added_id))
        sink.flush()
        assert (sink.direct, sink.staged) == (1, 0)
        # A restarted process replays cells 10..24 with new ones: the COPY hits the key, nothing of it stays.
        replay = PostgresSink(config)
        for cell in cells[10:]:
            replay.add(cell, Position(cell.shard, cell.added_id))
        replay.flush()
        assert (replay.direct, replay.staged) == (0, 1)
        replay.close()
    finally:
        sink.close()
    rows = psql(postgres_database, "SELECT row_key, ref_key, done FROM cells_status ORDER BY added_id")
    assert rows == [[str(c.row_key), str(c.ref_key), "t" if c.body["done"] else "f"] for c in cells]


def test_a_tombstone_marks_its_row_deleted_whatever_the_order(postgres_database: str) -> None:
    """A tombstone cell (a migrated row's deletion) is the row's state from its version on: ``deleted`` true and
    the promoted fields NULL in ``latest``, and an older cell loaded after it does not bring the row back;
    ``history`` keeps it as a row of its own."""
    from connectors.sinks.base import Position
    from connectors.sinks.postgres import PostgresSink, PostgresSinkConfig

    at = dt.datetime(2026, 11, 27, tzinfo=dt.UTC)
    row, kept = uuid.uuid4(), uuid.uuid4()

    def cell(key: uuid.UUID, ref_key: int, body: dict[str, object], added_id: int) -> logstore.Cell:
        return logstore.Cell(row_key=key, column="BASE", ref_key=ref_key, body=body, added_id=added_id, shard=1,
                             created_at=at)

    # Logged in this order (added_ids 1-4), the older version last: ref_keys need not follow the log.
    live, dead, older = (cell(row, 1, {"fare": 2.5}, 1), cell(row, 3, {"_deleted": True, "_key": [7]}, 3),
                         cell(row, 2, {"fare": 9.0}, 4))
    config = PostgresSinkConfig.model_validate(
        {"url": postgres_database, "columns": {"BASE": {"mode": "latest", "promote": [
            {"field": "fare", "type": "double"}]}, "NOTE": {"mode": "history"}}})
    sink = PostgresSink(config)
    try:
        for batch in ([live, cell(kept, 1, {"fare": 1.0}, 2)], [dead], [older]):
            for c in batch:
                sink.add(c, Position(c.shard, c.added_id))
            sink.flush()
        note = logstore.Cell(row_key=row, column="NOTE", ref_key=5, body={"_deleted": True}, added_id=5, shard=1,
                             created_at=at)
        sink.add(note, Position(1, 5))
        sink.flush()
    finally:
        sink.close()
    rows = psql(postgres_database, "SELECT row_key, ref_key, deleted, fare FROM cells_base ORDER BY ref_key DESC")
    assert rows == [[str(row), "3", "t", ""], [str(kept), "1", "f", "1"]]
    assert psql(postgres_database, "SELECT deleted FROM cells_note") == [["t"]]
    with pytest.raises(Exception, match="collide"):
        PostgresSinkConfig.model_validate({"url": postgres_database, "columns": {"BASE": {
            "mode": "latest", "promote": [{"field": "deleted", "type": "boolean"}]}}})
