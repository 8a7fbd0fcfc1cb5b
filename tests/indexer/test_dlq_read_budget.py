"""Readers of the dead-letter queue read on after a page cut short by the read's byte budget
(StoreOptions.max_read_bytes): a short page is the end of the queue only when it was not cut."""

from __future__ import annotations

import uuid
from pathlib import Path

import logstore
from cellstream.console.catalog import EntryCatalog
from indexer import App, NonRetriableError
from logstore.retry import RetryPolicy

CELLS = 40


class Declined(NonRetriableError):
    """Every cell fails: each becomes a dead letter of about a kilobyte (its body, the traceback)."""


def test_every_reader_of_the_queue_sees_every_entry_when_pages_are_cut_short(tmp_path: Path) -> None:
    with logstore.open(f"sqlite:///{tmp_path / 'store'}", shards=8, max_read_bytes=3_000) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i, "pad": "x" * 500}) for i in range(CELLS)])
        app = App("billing", store=store, backoff=RetryPolicy(initial=0.001, maximum=0.002, deadline=None))

        @app.trigger("BASE", max_attempts=1)
        def bill(cell: logstore.Cell) -> None:
            raise Declined(f"card {cell.body['i']} declined")

        with app:
            app.drain(timeout=60)
        assert len(app.dlq.deadletters.entries()) == CELLS
        assert app.dlq.deadletters.open_counts().read() == {"bill": CELLS}
        catalog = EntryCatalog({"billing": app.dlq.deadletters})
        catalog.refresh()
        assert len(catalog) == CELLS
