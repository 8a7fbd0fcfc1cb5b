"""Warehouse sink benchmark (issue 6): python bench/connect_bench.py [--cells N] [--shards N] [--postgres URL].

Each sink against the raw library doing the same write of the same rows, in the same run:

1. Parquet lake: ``ParquetSink.add`` for every cell, then ``flush`` (one file per column and date holding
   every shard's cells, zstd, committed through the lake's commit log) against pyarrow building the same
   rows (``Table.from_pylist`` of the flattened bodies with the cell's columns) and writing a file of the
   same rows with ``pyarrow.parquet.write_table``.
2. PostgreSQL: ``PostgresSink.add`` for every cell, then ``flush`` (history mode, two promoted columns:
   the COPY straight into the table that a replay would turn into staging plus an upsert) against psycopg
   COPYing the same rows straight into a table of the same shape, in one transaction. For information,
   the same cells into a ``latest`` table, which always goes through staging and ``INSERT ... ON
   CONFLICT DO UPDATE``.

Then, for information, the whole connector (``cellstream connect``'s runtime, direct mode) loading the
same cells into the lake, against the raw paged read of the log (``Store.get_cells_for_shards``, 512
shards a call, as a tailer reads); and the lake's file count: ``--cells`` cells written in batches of
1,000 while a connector with ``checkpoint_interval: 1`` runs, files and rows per file before and after
compaction (``connectors.compaction``, run as a job).

Rounds alternate which side goes first; each prints cells/s and the ratio (target >= 0.6). Results go to
bench/results/connect.json. The store is a fresh SQLite directory with ``--shards`` shards (default 4096,
the store's default);
PostgreSQL is the shared test server (``make services-up``) (a fresh database, dropped after).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lake_load import load_while_writing, timed, trips  # bench/: the script's folder

import logstore
from connectors.compaction import LakeCompaction, compaction_params
from connectors.config import ConnectorConfig
from connectors.runtime import connector_app
from connectors.sinks.base import Position, flatten, utc_date
from connectors.sinks.commits import read_state
from connectors.sinks.parquet import ParquetSink, ParquetSinkConfig
from connectors.sinks.postgres import PostgresSink, PostgresSinkConfig
from logstore.jobs import JobRunner, KindRegistry
from tests.harness.shared_servers import POSTGRES_SERVER as SERVER

READ_GROUP, PAGE = 512, 10_000  # the raw read: shards per get_cells_for_shards call, cells per shard page


# -- 1. parquet --------------------------------------------------------------------------------
def sink_parquet(cells: list[logstore.Cell], root: Path) -> None:
    sink = ParquetSink(ParquetSinkConfig(root=root))
    for cell in cells:
        sink.add(cell, Position(cell.shard, cell.added_id))
    sink.flush()


def raw_parquet(cells: list[logstore.Cell], root: Path) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        row = {"row_key": str(cell.row_key), "column": cell.column, "ref_key": cell.ref_key,
               "added_id": cell.added_id, "shard": cell.shard, "created_at": cell.created_at, **flatten(cell.body)}
        groups.setdefault(utc_date(cell.created_at), []).append(row)
    for date, rows in groups.items():
        directory = root / "BASE" / f"date={date}"
        directory.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), directory / "part-0.parquet", compression="zstd")


# -- 2. postgres -------------------------------------------------------------------------------
def sink_postgres(cells: list[logstore.Cell], url: str, table: str, mode: str = "history") -> None:
    sink = PostgresSink(PostgresSinkConfig.model_validate({"url": url, "columns": {"BASE": {
        "mode": mode, "table": table, "promote": [{"field": "city", "type": "text"},
                                                        {"field": "fare.total", "type": "double"}]}}}))
    for cell in cells:
        sink.add(cell, Position(cell.shard, cell.added_id))
    sink.flush()
    sink.close()


def raw_postgres(cells: list[logstore.Cell], url: str, table: str) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(f"CREATE TABLE {table} (row_key uuid NOT NULL, ref_key bigint NOT NULL, added_id bigint NOT NULL,"
                     " shard integer NOT NULL, created_at timestamptz NOT NULL, body jsonb NOT NULL, city text,"
                     " fare_total double precision, PRIMARY KEY (row_key, ref_key))")
        conn.commit()
        with conn.transaction(), conn.cursor() as cur, cur.copy(
                f"COPY {table} (row_key, ref_key, added_id, shard, created_at, body, city, fare_total) "
                "FROM STDIN") as copy:
            for c in cells:
                copy.write_row((c.row_key, c.ref_key, c.added_id, c.shard, c.created_at,
                                json.dumps(c.body, separators=(",", ":")), c.body["city"], c.body["fare"]["total"]))


def count(url: str, table: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        return int(row[0]) if row else 0


# -- 3. the whole connector ----------------------------------------------------------------------
def raw_read(store: logstore.Store) -> int:
    """The log's BASE cells paged through every shard, ``READ_GROUP`` shards a call; how many were read."""
    read, locations = 0, dict.fromkeys(range(store.shard_count), 0)
    while locations:
        shards = list(locations)
        for start in range(0, len(shards), READ_GROUP):
            group = {s: locations[s] for s in shards[start:start + READ_GROUP]}
            for shard, page in store.get_cells_for_shards(group, PAGE, columns=["BASE"]).items():
                assert isinstance(page, list), page
                read += len(page)
                if len(page) < PAGE:
                    del locations[shard]
                else:
                    locations[shard] = page[-1].added_id
    return read


def connector(store: logstore.Store, root: Path, n: int) -> dict[str, Any]:
    started = time.perf_counter()
    assert raw_read(store) == n
    read = time.perf_counter() - started
    config = ConnectorConfig.model_validate({"name": "bench", "columns": ["BASE"], "checkpoint_interval": 2.0,
                                             "sink": {"type": "parquet", "root": str(root)}})
    app, _ = connector_app(config, store)
    with app:
        seconds = timed(lambda: app.drain(timeout=600))
    return {"cells": n, "connector_cells_per_s": round(n / seconds), "raw_read_cells_per_s": round(n / read)}


def lake_files(tmp: Path, shards: int, n: int) -> dict[str, Any]:
    """Files and rows per file of a lake loaded while cells arrive, before and after compaction."""
    root, config_file = tmp / "filelake", tmp / "filelake.yaml"
    config_file.write_text(f"name: files\ncolumns: [BASE]\ncheckpoint_interval: 1\n"
                           f"sink: {{type: parquet, root: {root}}}\n")
    config = ConnectorConfig.model_validate({"name": "files", "columns": ["BASE"], "checkpoint_interval": 1.0,
                                             "sink": {"type": "parquet", "root": str(root)}})
    with logstore.open(f"sqlite:///{tmp}/filestore", shards=shards) as store:
        load_while_writing(store, config, n)
        before = sorted((root / "BASE").glob("date=*/*.parquet"))
        runner = JobRunner(store, KindRegistry([LakeCompaction()]))
        job = runner.submit("compact", compaction_params(config_file, before=dt.date(2099, 1, 1)))
        runner.run(job.id)
        after = sorted((root / "BASE").glob("date=*/*.parquet"))
    commits = read_state(root).seq
    return {"cells": n, "shards": shards, "commits": commits, "files_before": len(before),
            "rows_per_file_before": round(n / max(len(before), 1)), "files_after": len(after),
            "rows_per_file_after": round(n / max(len(after), 1))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shards", type=int, default=4096, help="shards of the store (default 4096, the store's)")
    parser.add_argument("--postgres", default=SERVER, help="a postgresql:// server URL without a database")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "connect.json"))
    args = parser.parse_args(argv)
    database = f"csbench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{args.postgres}/postgres", autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")
    url = f"{args.postgres}/{database}"
    totals = {"parquet sink": 0.0, "pyarrow": 0.0, "postgres sink": 0.0, "COPY": 0.0, "latest sink": 0.0}
    try:
        with tempfile.TemporaryDirectory(prefix="cellstream-bench-") as tmp, \
                logstore.open(f"sqlite:///{tmp}/store", shards=args.shards) as store:
            cells = trips(store, args.cells)
            # The input held in memory is neither side's work: out of the collector's reach, its 100,000
            # cells no longer make either side's garbage collections slower (and the ratios noisy).
            gc.collect()
            gc.freeze()
            for r in range(args.rounds):
                sides: list[tuple[str, Callable[[], Any]]] = [
                    ("parquet sink", partial(sink_parquet, cells, Path(tmp) / f"sink{r}")),
                    ("pyarrow", partial(raw_parquet, cells, Path(tmp) / f"raw{r}")),
                    ("postgres sink", partial(sink_postgres, cells, url, f"sink{r}")),
                    ("COPY", partial(raw_postgres, cells, url, f"raw{r}")),
                    ("latest sink", partial(sink_postgres, cells, url, f"latest{r}", "latest"))]
                for pair in (sides[:2], sides[2:4]):
                    for name, fn in pair if r % 2 == 0 else pair[::-1]:
                        totals[name] += timed(fn)
                assert count(url, f"sink{r}") == count(url, f"raw{r}") == len(cells)
                # No raw write does what a latest table does: timed on its own, for information.
                totals["latest sink"] += timed(sides[4][1])
                assert count(url, f"latest{r}") == len(cells)
            whole = connector(store, Path(tmp) / "connector", len(cells))
            sizing = lake_files(Path(tmp), args.shards, args.cells)
    finally:
        with psycopg.connect(f"{args.postgres}/postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
    n = args.cells * args.rounds
    rate = {name: n / seconds for name, seconds in totals.items()}
    result = {"cells": args.cells, "rounds": args.rounds, "shards": args.shards,
              "parquet": {"sink_cells_per_s": round(rate["parquet sink"]),
                          "pyarrow_cells_per_s": round(rate["pyarrow"]),
                          "ratio": round(rate["parquet sink"] / rate["pyarrow"], 3), "target": ">= 0.6"},
              "postgres": {"sink_cells_per_s": round(rate["postgres sink"]), "copy_cells_per_s": round(rate["COPY"]),
                           "ratio": round(rate["postgres sink"] / rate["COPY"], 3), "target": ">= 0.6",
                           "latest_sink_cells_per_s": round(rate["latest sink"]),
                           "latest_ratio": round(rate["latest sink"] / rate["COPY"], 3)},
              "connector": whole, "lake_files": sizing}
    for name, raw in (("parquet", "pyarrow"), ("postgres", "copy")):
        part = result[name]
        assert isinstance(part, dict)
        print(f"{name} sink: {part['sink_cells_per_s']} cells/s; raw {raw}: {part[raw + '_cells_per_s']} cells/s; "
              f"ratio {part['ratio']} (target >= 0.6: {'met' if part['ratio'] >= 0.6 else 'MISSED'})", flush=True)
    postgres = result["postgres"]
    assert isinstance(postgres, dict)
    print(f"postgres sink, latest table (staging + upsert): {postgres['latest_sink_cells_per_s']} cells/s; "
          f"ratio to COPY {postgres['latest_ratio']} (for information)")
    print(f"connector (runtime + parquet sink): {whole['connector_cells_per_s']} cells/s; raw paged read of the "
          f"log {whole['raw_read_cells_per_s']} cells/s (for information)")
    print(f"lake files: {sizing['cells']} cells in batches of 1,000, checkpoint every 1 s, {sizing['shards']} "
          f"shards: {sizing['commits']} commits, {sizing['files_before']} files ({sizing['rows_per_file_before']} "
          f"rows a file); after compaction {sizing['files_after']} ({sizing['rows_per_file_after']} rows a file)")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
