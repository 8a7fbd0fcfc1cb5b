"""What a backfill counts (the cells of its index's column, as its progress and its result both say) and how it
passes a cell that cannot be decoded: one up to its target is dead-lettered, one past it is the app's."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from pathlib import Path

import logstore
from indexer import App
from indexer.indexes.backfill import BackfillProgress, BackfillResult, backfill
from tests.harness.index_support import SEED_YAML, trip

NAME = "driver_partner_index"


def corrupt(sqlite_url: str, cell: logstore.Cell) -> None:
    with sqlite3.connect(Path(sqlite_url.removeprefix("sqlite:///")) / "logstore.db") as conn:
        conn.execute("UPDATE cells SET body = x'7f00' WHERE added_id = ?", (cell.added_id,))


def test_progress_and_result_count_the_columns_cells_and_a_damaged_cell_past_the_target_ends_no_shard(
        sqlite_url: str, tmp_path: Path) -> None:
    yaml_file = tmp_path / "v1.yaml"
    yaml_file.write_text(SEED_YAML)
    driver, city = uuid.uuid4(), uuid.uuid4()
    with logstore.open(sqlite_url, shards=1) as store:
        # BASE and OTHER cells in turn: the shard's head, the target, is an OTHER cell.
        written = store.put_cells([(uuid.uuid4(), column, 1, trip(driver, city, i))
                                   for i in range(10) for column in ("BASE", "OTHER")])
        with App("trips", store=store, start_from="now") as app:  # keeps the version; nothing of it live
            app.index(yaml_file)
            app.drain(timeout=30)
        halted = threading.Event()
        halted.set()
        assert backfill(store, NAME, 1, stop=halted).shards == 0  # the targets are set; nothing read yet
        corrupt(sqlite_url, written[8])  # the fifth BASE cell, up to the target
        corrupt(sqlite_url, store.put_cell(uuid.uuid4(), "BASE", 1, trip(driver, city, 99)))  # past it

        reports: list[BackfillProgress] = []
        results: list[BackfillResult] = []
        stop = threading.Event()
        thread = threading.Thread(target=lambda: results.append(
            backfill(store, NAME, 1, batch=4, workers=1, progress=reports.append, stop=stop)))
        thread.start()
        thread.join(20)
        stop.set()
        thread.join(20)
        assert results, "the backfill went round the damaged cell past its target until stopped"
        [result] = results
        assert (result.shards, result.cells, result.dead_lettered) == (1, 10, 1)
        assert (reports[0].cells_done, reports[0].cells) == (0, 10)  # not the 20 cells of both columns
        assert (reports[-1].cells_done, reports[-1].cells) == (10, 10)
        with App("trips", store=store) as app:
            [entry] = app.dlq.list()
        assert entry.cell["added_id"] == written[8].added_id and entry.error_type.endswith("CorruptCellError")
