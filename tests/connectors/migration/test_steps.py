"""The writes of a migration switched to the store and back (``migrate switch --writes``, ``reverse``,
``complete``) against real sources, with a `cellstream migrate start` process following the migration and an
application writing through the write facade the whole time: nothing written on either side is lost, the source
table ends equal to the cells, and every step refuses to run out of order."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import logstore
from connectors.errors import MigrationStateError, MigrationSwitchingError
from connectors.migration.diff import diff
from connectors.migration.opening import open_source
from connectors.migration.records import MigrationRecords
from connectors.migration.spec import load_migration
from connectors.migration.writes import MigrationWriter
from tests.connectors.migration.test_mover import NAMESPACE, SourceDB

CLI = [sys.executable, "-m", "cellstream", "migrate"]
Row = tuple[str, Decimal, str | None]


def spec_text(url: str) -> str:
    """The tests' migration: the key ``id`` among the cells' fields, so the flow back can name a row."""
    return f"""
name: trips
source: {{url: "{url}", table: trips}}
row_key: {{uuid5: {NAMESPACE}}}
columns:
  BASE: [id, rider, fare]
  NOTE: [note]
"""


@pytest.fixture
def migration(source_db: SourceDB, tmp_path: Path) -> tuple[Path, str]:
    """The migration's declaration file, and the URL of a new store (64 shards) it moves the table into."""
    spec_file = tmp_path / "trips.yaml"
    spec_file.write_text(spec_text(source_db.url))
    store_url = f"sqlite:///{tmp_path}/store"
    with logstore.open(store_url, shards=64):
        pass
    return spec_file, store_url


def migrate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


class Writer(threading.Thread):
    """The application: upserts and deletes through the write facade until stopped, keeping what each
    acknowledged write left (key -> row, None: deleted) and where the writes went."""

    def __init__(self, spec_file: Path, store_url: str, expected: dict[int, Row | None]) -> None:
        super().__init__(daemon=True)
        self.spec = load_migration(spec_file)
        self.store_url = store_url
        self.expected = expected
        self.stop = threading.Event()
        self.sides: dict[str, int] = {"source": 0, "store": 0}
        self.held = 0  # writes that met a step under way and were tried again
        self.failure: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(11)
        try:
            with logstore.open(self.store_url) as store, MigrationWriter(self.spec, store, fence_wait=0.5) as writer:
                n = 0
                while not self.stop.is_set():
                    key = rng.randint(1, 2600)
                    n += 1
                    try:
                        if rng.random() < 0.8:
                            # The fare as the numeric(8, 2) column writes it: "12.50", the store's body too.
                            fare = (Decimal(n % 5000) / 4).quantize(Decimal("0.01"))
                            row: Row = (f"w{n}", fare, f"n{n}" if n % 3 else None)
                            side = writer.put({"id": key, "rider": row[0], "fare": row[1], "note": row[2]})
                            self.expected[key] = row
                        else:
                            side = writer.delete((key,))
                            self.expected[key] = None
                    except MigrationSwitchingError:
                        self.held += 1
                        continue
                    self.sides[side] += 1
                    time.sleep(0.002)
        except BaseException as exc:  # seen by the test, not lost in the thread
            self.failure = exc


class Follower(subprocess.Popen[str]):
    """A `migrate start` process following the migration, its log in a file beside the declaration (a pipe
    nobody reads could fill and stop it)."""

    def __init__(self, spec_file: Path, store_url: str, *extra: str) -> None:
        self.log = spec_file.with_name(f"start-{time.monotonic_ns()}.log")
        with self.log.open("w") as out:
            super().__init__([*CLI, "start", str(spec_file), "--store", store_url, *extra],
                             stdout=subprocess.DEVNULL, stderr=out, text=True)

    def said(self) -> str:
        """What it logged, once stopped (for a failure's message)."""
        if self.poll() is None:
            self.terminate()
            self.wait(timeout=60)
        return self.log.read_text()[-4000:]


def source_rows(db: SourceDB) -> dict[int, Row]:
    return {int(k): (r, Decimal(f), n) for k, r, f, n in db.execute("SELECT id, rider, fare, note FROM trips")}


def wait_for_phase(store_url: str, phase: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with logstore.open(store_url) as store:
            record = MigrationRecords(store).find("trips")
        if record is not None and record.phase == phase:
            return
        assert time.monotonic() < deadline, f"not {phase}: {record}"
        time.sleep(0.2)


def test_writes_switched_to_the_store_and_back_lose_nothing(source_db: SourceDB, migration: tuple[Path, str]) -> None:
    spec_file, store_url = migration
    expected: dict[int, Row | None] = {k: (f"r{k}", Decimal(k) * Decimal("1.25"), None) for k in range(1, 2001)}
    mover = Follower(spec_file, store_url, "--chunk-rows", "400")
    writer = Writer(spec_file, store_url, expected)
    try:
        wait_for_phase(store_url, "copied")
        writer.start()
        refused = migrate("switch", str(spec_file), "--writes", "--store", store_url)
        assert refused.returncode == 9 and "--reads 100" in refused.stderr, refused.stderr  # reads come first
        refused = migrate("reverse", str(spec_file), "--store", store_url)
        assert refused.returncode == 9 and "switch --writes" in refused.stderr, refused.stderr
        assert migrate("switch", str(spec_file), "--reads", "100", "--store", store_url).returncode == 0
        time.sleep(0.5)
        before = dict(writer.sides)
        switched = migrate("switch", str(spec_file), "--writes", "--store", store_url)
        assert switched.returncode == 0, switched.stderr + mover.said()
        time.sleep(2.0)
        assert writer.sides["store"] > before["store"]  # the application writes to the store now
        cancel = migrate("cancel", str(spec_file), "--store", store_url)
        assert cancel.returncode == 9 and "reverse" in cancel.stderr, cancel.stderr  # the way back stays
        reversed_ = migrate("reverse", str(spec_file), "--store", store_url)
        assert reversed_.returncode == 0, reversed_.stderr
        at_reverse = dict(writer.sides)
        time.sleep(1.5)
        assert writer.sides["source"] > at_reverse["source"]  # and to the source again
        writer.stop.set()
        writer.join()
        assert writer.failure is None, writer.failure
        # The capture applies the source's last changes; then both sides hold exactly what was acknowledged.
        with logstore.open(store_url) as store:
            spec = load_migration(spec_file)
            source = open_source(spec, capture=False)
            try:
                deadline = time.monotonic() + 30
                while not (report := diff(spec, source, store, chunk_rows=500)).clean:
                    assert time.monotonic() < deadline, report.listed[:5]
                    time.sleep(0.5)
            finally:
                source.close()
        assert source_rows(source_db) == {k: row for k, row in expected.items() if row is not None}
        assert writer.sides["store"] > 50 and writer.sides["source"] > 50, writer.sides
    finally:
        writer.stop.set()
        mover.terminate()
        err = mover.said()
    assert mover.returncode == 0, err


def test_complete_ends_the_flow_back_and_drops_the_capture(source_db: SourceDB, migration: tuple[Path, str]) -> None:
    spec_file, store_url = migration
    assert migrate("start", str(spec_file), "--store", store_url, "--until-caught-up").returncode == 0
    assert migrate("switch", str(spec_file), "--reads", "100", "--store", store_url).returncode == 0
    # No process follows the migration: the switch is called off, and the writes stay on the source.
    alone = migrate("switch", str(spec_file), "--writes", "--store", store_url, "--wait", "1")
    assert alone.returncode == 9 and "called off" in alone.stderr, alone.stderr
    spec = load_migration(spec_file)
    with logstore.open(store_url) as store, MigrationWriter(spec, store) as writer:
        assert MigrationRecords(store).get("trips").phase == "copied"
        assert writer.put({"id": 1, "rider": "before", "fare": Decimal("1.00"), "note": None}) == "source"
    mover = Follower(spec_file, store_url)
    try:
        assert migrate("switch", str(spec_file), "--writes", "--store", store_url).returncode == 0
        with logstore.open(store_url) as store, MigrationWriter(spec, store) as writer:
            assert writer.put({"id": 1, "rider": "after", "fare": Decimal("2.00"), "note": "x"}) == "store"
            assert writer.put({"id": 9000, "rider": "new", "fare": Decimal("3.50"), "note": None}) == "store"
            assert writer.delete((2,)) == "store"
        done = migrate("complete", str(spec_file), "--store", store_url)
        assert done.returncode == 0, done.stderr
        mover.wait(timeout=60)  # the process following it ends with it
        assert mover.returncode == 0, mover.said()
    finally:
        if mover.poll() is None:
            mover.kill()
            mover.wait()
    # What the store took before the end flowed back; the source's capture is gone.
    rows = source_rows(source_db)
    assert rows[1] == ("after", Decimal("2.00"), "x") and rows[9000] == ("new", Decimal("3.50"), None)
    assert 2 not in rows
    if source_db.kind == "postgres":
        assert source_db.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()") \
            == [(0,)]
    with logstore.open(store_url) as store, MigrationWriter(spec, store) as writer:
        assert writer.put({"id": 1, "rider": "later", "fare": Decimal("4.00"), "note": None}) == "store"
    assert source_rows(source_db)[1] == ("after", Decimal("2.00"), "x")  # no flow back after the end
    again = migrate("reverse", str(spec_file), "--store", store_url)
    assert again.returncode == 9 and "completed" in again.stderr
    status = migrate("status", str(spec_file), "--store", store_url)  # the capture gone, nothing lags
    assert status.returncode == 0 and "completed" in status.stdout and "cells flowed back" in status.stdout, \
        status.stderr


def test_a_write_waits_while_the_writes_move_then_says_so(source_db: SourceDB, migration: tuple[Path, str]) -> None:
    """The fence: while a step moves the writes, the facade writes nowhere; past its wait it raises a retriable
    error, and the write is on neither side."""
    spec_file, store_url = migration
    assert migrate("start", str(spec_file), "--store", store_url, "--until-caught-up").returncode == 0
    spec = load_migration(spec_file)
    with logstore.open(store_url) as store:
        records = MigrationRecords(store)

        def to(phase: Any) -> None:
            def change(record: Any) -> None:
                record.phase = phase
            records.change("trips", change)
        to("switching")
        with MigrationWriter(spec, store, fence_wait=0.3) as writer:
            started = time.monotonic()
            with pytest.raises(MigrationSwitchingError) as held:
                writer.put({"id": 5, "rider": "held", "fare": Decimal("1.00"), "note": None})
            assert held.value.retriable and time.monotonic() - started >= 0.3
            assert source_rows(source_db)[5][0] == "r5"
            cell = store.get_cell_latest(writer._mapper.row_key((5,), None), "BASE")
            assert cell is not None and cell.body["rider"] == "r5"
            to("copied")
            writer._read_at = -10.0  # its lease over: it reads the record at the next write
            assert writer.put({"id": 5, "rider": "free", "fare": Decimal("1.00"), "note": None}) == "source"
        with pytest.raises(MigrationStateError):
            MigrationWriter(load_migration(spec_text(source_db.url).replace("name: trips", "name: other")), store)


def test_a_process_killed_while_it_flows_back_is_taken_over_by_the_next(
        source_db: SourceDB, migration: tuple[Path, str]) -> None:
    """The flow back's positions are in the store, claimed by one process at a time: a `migrate start` SIGKILLed
    with cells still to flow back is followed by a new one that claims them and writes every row back."""
    spec_file, store_url = migration
    assert migrate("start", str(spec_file), "--store", store_url, "--until-caught-up").returncode == 0
    assert migrate("switch", str(spec_file), "--reads", "100", "--store", store_url).returncode == 0
    spec = load_migration(spec_file)
    first = Follower(spec_file, store_url)
    second: Follower | None = None
    try:
        assert migrate("switch", str(spec_file), "--writes", "--store", store_url).returncode == 0
        expected = {}
        with logstore.open(store_url) as store, MigrationWriter(spec, store) as writer:
            for key in range(1, 801):
                row = {"id": key, "rider": f"k{key}", "fare": Decimal(key) / 4 + Decimal("0.01"), "note": "killed"}
                assert writer.put(row) == "store"
                expected[key] = (f"k{key}", row["fare"], "killed")
            first.kill()  # mid-flow-back, or just after: the next process must not depend on which
            first.wait()
            flowed = MigrationRecords(store).get("trips").flowed_back
            second = Follower(spec_file, store_url)
            for key in range(801, 901):
                row = {"id": key, "rider": f"k{key}", "fare": Decimal("1.00"), "note": "second"}
                assert writer.put(row) == "store"
                expected[key] = (f"k{key}", Decimal("1.00"), "second")
        back = migrate("reverse", str(spec_file), "--store", store_url)
        assert back.returncode == 0, back.stderr + (second.said() if second else "")
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    rows = source_rows(source_db)
    assert {k: rows.get(k) for k in expected} == expected
    with logstore.open(store_url) as store:
        assert MigrationRecords(store).get("trips").flowed_back > flowed
