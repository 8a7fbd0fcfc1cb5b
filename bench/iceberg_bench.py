"""Iceberg sink benchmark (issue 50): python bench/iceberg_bench.py [--cells N] [--shards N] [--rounds N].

1. The Iceberg sink (``IcebergSink.add`` for every cell, then ``flush``: one snapshot, one data file per day
   partition, the offsets in its summary, on a SQLite catalog) against pyiceberg's own ``Table.append`` of the
   same rows (an Arrow table built from the flattened bodies with the cell's columns), into a table of the same
   schema and partitioning (``day(created_at)``) in a catalog of its own. Rounds alternate which side goes first;
   each prints cells/s and the ratio (target >= 0.5).
2. Files per ``--cells`` cells and rows per file, before and after compaction: the cells written in batches of
   1,000 while a connector with ``checkpoint_interval: 1`` runs (``cellstream connect``'s runtime, direct mode),
   then ``connectors.compaction`` run as a job (every day before 2099 closed, snapshots kept).

The store is a fresh SQLite directory with ``--shards`` shards (default 4096, the store's default). Results go to
bench/results/iceberg.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import schema_to_pyarrow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lake_load import load_while_writing, timed, trips  # bench/: the script's folder

import logstore
from connectors.compaction import LakeCompaction, compaction_params
from connectors.config import ConnectorConfig, IcebergSinkConfig
from connectors.sinks.base import Position, flatten, json_text
from connectors.sinks.iceberg import _SPEC, IcebergSink
from logstore.jobs import JobRunner, KindRegistry


def sink_config(folder: Path) -> IcebergSinkConfig:
    return IcebergSinkConfig(catalog=f"sqlite:///{folder}/catalog.db", warehouse=str(folder / "warehouse"))


def sink_iceberg(cells: list[logstore.Cell], folder: Path) -> None:
    sink = IcebergSink(sink_config(folder), "bench")
    for cell in cells:
        sink.add(cell, Position(cell.shard, cell.added_id))
    sink.flush()
    sink.close()


def raw_table(folder: Path, like: Path) -> Any:
    """A table of the sink's schema and partitioning (that of the sink's table under ``like``), empty."""
    sink = IcebergSink(sink_config(like), "schema")
    table = sink.table("BASE")
    assert table is not None
    schema = table.schema()
    sink.close()
    catalog = SqlCatalog("raw", uri=f"sqlite:///{folder}/catalog.db", warehouse=(folder / "warehouse").as_uri())
    catalog.create_namespace("raw")
    return catalog.create_table(("raw", "cells_base"), schema, partition_spec=_SPEC,
                                properties={"write.target-file-size-bytes": str(128 << 20)})


def raw_append(cells: list[logstore.Cell], folder: Path, like: Path) -> None:
    """pyiceberg's ``append`` of the same rows, the Arrow table built as pyarrow's users build one, into a
    table created here (the sink creates its catalog and table in its run too)."""
    table = raw_table(folder, like)
    schema = schema_to_pyarrow(table.schema())
    rows = []
    for cell in cells:
        row = {"row_key": str(cell.row_key), "column": cell.column, "ref_key": cell.ref_key,
               "added_id": cell.added_id, "shard": cell.shard, "created_at": cell.created_at}
        for name, value in flatten(cell.body).items():
            row[name] = value if isinstance(value, (bool, int, float, str)) else json_text(value)
        rows.append(row)
    table.append(pa.Table.from_pylist(rows, schema=schema))


def live_files(config: IcebergSinkConfig) -> int:
    sink = IcebergSink(config, "reader")
    table = sink.table("BASE")
    count = len(list(table.scan().plan_files())) if table is not None else 0
    sink.close()
    return count


def table_files(tmp: Path, shards: int, n: int) -> dict[str, Any]:
    """Data files and rows per file of a table loaded while cells arrive, before and after compaction."""
    folder, config_file = tmp / "files", tmp / "files.yaml"
    folder.mkdir()
    sink = {"type": "iceberg", "catalog": f"sqlite:///{folder}/catalog.db", "warehouse": str(folder / "warehouse")}
    config_file.write_text(json.dumps({"name": "files", "columns": ["BASE"], "checkpoint_interval": 1,
                                       "sink": sink}))
    config = ConnectorConfig.model_validate({"name": "files", "columns": ["BASE"], "checkpoint_interval": 1.0,
                                             "sink": sink})
    with logstore.open(f"sqlite:///{tmp}/filestore", shards=shards) as store:
        applier = load_while_writing(store, config, n)
        commits = getattr(applier.sink, "snapshots_committed", 0)
        assert isinstance(config.sink, IcebergSinkConfig)
        before = live_files(config.sink)
        runner = JobRunner(store, KindRegistry([LakeCompaction()]))
        job = runner.submit("compact", compaction_params(config_file, before=dt.date(2099, 1, 1)))
        started = time.perf_counter()
        assert runner.run(job.id).state == "done"
        seconds = time.perf_counter() - started
        after = live_files(config.sink)
    return {"cells": n, "shards": shards, "snapshots": commits, "files_before": before,
            "rows_per_file_before": round(n / max(before, 1)), "files_after": after,
            "rows_per_file_after": round(n / max(after, 1)), "compaction_seconds": round(seconds, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shards", type=int, default=4096, help="shards of the store (default 4096, the store's)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "iceberg.json"))
    args = parser.parse_args(argv)
    totals = {"iceberg sink": 0.0, "pyiceberg append": 0.0}
    with tempfile.TemporaryDirectory(prefix="cellstream-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with logstore.open(f"sqlite:///{tmp}/store", shards=args.shards) as store:
            cells = trips(store, args.cells)
        (tmp / "schema").mkdir()
        sink_iceberg(cells[:100], tmp / "schema")  # the table whose schema the raw side copies
        gc.collect()
        gc.freeze()  # the input is neither side's work: out of the collector's reach
        for r in range(args.rounds):
            for side in ("raw", "sink"):
                (tmp / f"{side}{r}").mkdir()
            sides: list[tuple[str, Callable[[], Any]]] = [
                ("iceberg sink", partial(sink_iceberg, cells, tmp / f"sink{r}")),
                ("pyiceberg append", partial(raw_append, cells, tmp / f"raw{r}", tmp / "schema"))]
            for name, fn in sides if r % 2 == 0 else sides[::-1]:
                totals[name] += timed(fn)
            assert live_files(sink_config(tmp / f"sink{r}")) >= 1
        gc.unfreeze()
        sizing = table_files(tmp, args.shards, args.cells)
    rate = {name: args.cells * args.rounds / seconds for name, seconds in totals.items()}
    ratio = rate["iceberg sink"] / rate["pyiceberg append"]
    result = {"cells": args.cells, "rounds": args.rounds, "shards": args.shards,
              "iceberg": {"sink_cells_per_s": round(rate["iceberg sink"]),
                          "pyiceberg_append_cells_per_s": round(rate["pyiceberg append"]),
                          "ratio": round(ratio, 3), "target": ">= 0.5"},
              "table_files": sizing}
    print(f"iceberg sink: {round(rate['iceberg sink'])} cells/s; pyiceberg append: "
          f"{round(rate['pyiceberg append'])} cells/s; ratio {ratio:.3f} (target >= 0.5: "
          f"{'met' if ratio >= 0.5 else 'MISSED'})", flush=True)
    print(f"table files: {sizing['cells']} cells in batches of 1,000, checkpoint every 1 s, {sizing['shards']} "
          f"shards: {sizing['snapshots']} snapshots, {sizing['files_before']} data files "
          f"({sizing['rows_per_file_before']} rows a file); after compaction {sizing['files_after']} "
          f"({sizing['rows_per_file_after']} rows a file, {sizing['compaction_seconds']} s)")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
