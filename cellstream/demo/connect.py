"""The connector part of the demo: ``examples/lake.yaml`` (beside this module) loads BASE and STATUS into a
Parquet lake, read back with pyarrow; a second run loads only what is new."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import TextIO

import pyarrow.parquet as pq

import logstore
from connectors.config import ParquetSinkSpec, load_connector
from connectors.runtime import connector_app
from connectors.sinks.base import CELL_COLUMNS
from connectors.sinks.parquet import ParquetSink

EXAMPLE = Path(__file__).resolve().parent / "examples" / "lake.yaml"


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out, flush=True)


def connect_demo(store: logstore.Store, out: TextIO) -> None:
    _say(out, f"\n== 10. a warehouse connector: {EXAMPLE.name} loads BASE and STATUS into a Parquet lake")
    with tempfile.TemporaryDirectory(prefix="cellstream-lake-") as tmp:
        config = load_connector(EXAMPLE)
        assert isinstance(config.sink, ParquetSinkSpec)
        lake = config.sink.model_copy(update={"root": Path(tmp) / "lake"})
        config, root = config.model_copy(update={"sink": lake}), lake.root
        for run in (1, 2):
            sink = ParquetSink(lake)
            app, _ = connector_app(config, store, sink)
            with app:
                counts = app.drain(timeout=60)
            _say(out, f"   cellstream connect run {EXAMPLE.name} --drain (run {run}): loaded {counts.processed} cells, "
                      f"dead-lettered {counts.dead_lettered}, {sink.files_written} files written")
            for conflict in sink.conflicts:
                _say(out, f"   schema: {conflict}")
            if run == 1:
                files = sorted(p.relative_to(root) for p in root.glob("*/date=*/*.parquet"))
                _say(out, f"   {len(files)} files, e.g. {files[0]}")
                store.put_cell(uuid.uuid4(), "BASE", 1, {"city": "Aarhus", "fare": 12.5, "promo": "NEW"})
                _say(out, "   a new trip arrives, with a field no trip had before (promo)")
        for column in config.columns:
            files = sorted((root / column).glob("date=*/*.parquet"))
            rows = sum(pq.read_metadata(f).num_rows for f in files)
            names = sorted({n for f in files for n in pq.read_schema(f).names} - set(CELL_COLUMNS))
            _say(out, f"   {column}: {rows} rows (one per cell) in {len(files)} files; body fields as columns "
                      f"(files unified by name, as DuckDB's union_by_name reads them): {', '.join(names)}")
