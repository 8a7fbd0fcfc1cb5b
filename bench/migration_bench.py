"""A migration's copy and change lag against the raw pipeline (issue 53, "Benchmarks": copy rate >= 0.7 of the raw
pipeline doing the same work; change lag p99 <= 1 s at 1,000 source writes/s).

    python bench/migration_bench.py [--source URL] [--store-server URL] [--shards 4096] [--rows 100000]
                                    [--rounds 2] [--writes 1000] [--seconds 20]

A table of ``--rows`` rows (a bigint key, a text, a numeric, a text) in a fresh database of the PostgreSQL with
``wal_level=logical`` at ``--source``; two fresh stores of ``--shards`` shards on the MariaDB at
``--store-server``. Each round times, in alternating order:

- the raw pipeline: a server-side cursor over the table in key order (psycopg, 1,000 rows a fetch), each batch
  mapped to cells by the same :class:`RowMapper` and written with ``put_cells``: the same work, without chunks,
  snapshots, a cursor record or change capture;
- the migration: :class:`Mover` with ``chunk_rows=1000``, ``follow=False``: the chunks in snapshots, the cursor
  recorded after each, the (empty) changes read after each, into the other store.

Ratio: raw time / migration time (the ratio of the rates). Then the change lag: the migration follows while a
writer updates random rows at ``--writes`` a second for ``--seconds``, each update stamping the row with its
commit time; the lag of a change is the time its cells are stored less that stamp. Printed with p50/p99/max;
written to ``bench/results/migration.json``. Every database, slot and store made is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

import logstore
from bench.scratch import drop_database
from connectors.migration.mapping import MigratedCell, RowMapper
from connectors.migration.mover import Mover
from connectors.migration.opening import open_source
from connectors.migration.source import SourceRow
from connectors.migration.spec import MigrationSpec, load_migration

RESULTS = Path(__file__).resolve().parent / "results" / "migration.json"
NAMESPACE = "6ba7b811-9dad-11d1-80b4-00c04fd430c8"


def spec_for(url: str, name: str, base: str = "rider, fare") -> MigrationSpec:
    """The benches' migration of ``trips``: ``base`` the fields of its BASE column."""
    return load_migration(f"""
name: {name}
source: {{url: "{url}", table: trips}}
row_key: {{uuid5: {NAMESPACE}}}
columns:
  BASE: [{base}]
  NOTE: [note]
""")


def source_table(server: str, database: str, rows: int) -> str:
    """A new database on the PostgreSQL at ``server`` holding ``trips`` with ``rows`` rows: its URL."""
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}"')
    url = urlunsplit(urlsplit(server)._replace(path=f"/{database}"))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE trips (id bigint PRIMARY KEY, rider text, fare numeric(12, 2), note text)")
        conn.execute("INSERT INTO trips SELECT i, 'rider ' || i, i * 0.25, 'n' FROM generate_series(1, %s) i",
                     (rows,))
        conn.execute("VACUUM ANALYZE trips")
    return url


def drop_source(server: str, database: str) -> None:
    """Drop a database :func:`source_table` made, and the replication slots left on it."""
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                      (database,))
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def timed_raw(spec: MigrationSpec, url: str, store: logstore.Store) -> float:
    mapper = RowMapper(spec)
    started = time.perf_counter()
    with psycopg.connect(url) as conn, conn.cursor(name="raw") as cur:
        cur.execute("SELECT id, rider, fare, note FROM trips ORDER BY id")
        while rows := cur.fetchmany(1000):
            cells = [c for r in rows for c in mapper.cells(
                SourceRow((r[0],), {"id": r[0], "rider": r[1], "fare": r[2], "note": r[3]}), 1)]
            store.put_cells([(c.row_key, c.column, c.ref_key, c.body) for c in cells])
    return time.perf_counter() - started


def timed_mover(spec: MigrationSpec, store: logstore.Store) -> float:
    source = open_source(spec)
    try:
        started = time.perf_counter()
        Mover(spec, source, store, chunk_rows=1000).run(follow=False)
        return time.perf_counter() - started
    finally:
        source.stop_changes()
        source.close()


class _TimedMover(Mover):
    """The migration, noting when each change's cells are stored (the bench's probe, not the product's)."""

    lags: list[float]

    def _put(self, cells: list[MigratedCell]) -> None:
        super()._put(cells)
        stored = time.time()
        self.lags += [stored - float(c.body["note"]) for c in cells
                      if c.column == "NOTE" and isinstance(c.body.get("note"), str) and c.body["note"][:1].isdigit()]


def paced(writes: int, seconds: float) -> Iterator[int]:
    """0, 1, 2...: each at its time of a steady ``writes`` a second, for ``seconds``."""
    started = time.monotonic()
    sent = 0
    while time.monotonic() - started < seconds:
        if (wait := started + sent / writes - time.monotonic()) > 0:
            time.sleep(wait)
        yield sent
        sent += 1


def change_lag(spec: MigrationSpec, url: str, store: logstore.Store, writes: int, seconds: float,
               rows: int) -> tuple[list[float], int, float]:
    """The lags of the changes stored, the updates sent, and the seconds the sending took."""
    source = open_source(spec)
    mover = _TimedMover(spec, source, store, chunk_rows=1000)
    mover.lags = []
    mover.run(follow=False)
    stop = threading.Event()
    follower = threading.Thread(target=mover.run, kwargs={"stop": stop, "idle": 0.01}, daemon=True)
    follower.start()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            started = time.monotonic()
            sent = 0
            for n in paced(writes, seconds):
                conn.execute("UPDATE trips SET note = %s WHERE id = %s", (repr(time.time()), 1 + n % rows))
                sent = n + 1
            took = time.monotonic() - started
        deadline = time.monotonic() + 30
        while len(mover.lags) < sent and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        follower.join()
        source.stop_changes()
        source.close()
    return mover.lags, sent, took


def run(args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    database = f"bench_migrate_{tag}"
    stores = [f"{args.store_server}/bench_migrate_{tag}_{i}" for i in range(2 * args.rounds + 1)]
    rounds: list[dict[str, Any]] = []
    url = source_table(args.source, database, args.rows)
    try:
        for r in range(args.rounds):
            spec = spec_for(url, f"bench-{tag}-{r}")
            with logstore.open(stores[2 * r], shards=args.shards) as raw_store, \
                    logstore.open(stores[2 * r + 1], shards=args.shards) as mover_store:
                if r % 2 == 0:
                    t_raw = timed_raw(spec, url, raw_store)
                    t_mover = timed_mover(spec, mover_store)
                else:
                    t_mover = timed_mover(spec, mover_store)
                    t_raw = timed_raw(spec, url, raw_store)
            rounds.append({"raw_s": t_raw, "mover_s": t_mover, "ratio": t_raw / t_mover,
                           "rows_per_s": args.rows / t_mover})
        with logstore.open(stores[-1], shards=args.shards) as store:
            found, sent, took = change_lag(spec_for(url, f"bench-{tag}-lag"), url, store, args.writes, args.seconds,
                                           args.rows)
            lags = sorted(found)
    finally:
        for store_url in stores:
            drop_database(store_url)
        drop_source(args.source, database)
    def p(q: float) -> float:
        return lags[min(len(lags) - 1, int(q * len(lags)))] if lags else float("nan")
    return {"shards": args.shards, "rows": args.rows, "rounds": rounds,
            "ratio": statistics.mean(r["ratio"] for r in rounds), "changes": len(lags), "sent": sent,
            "writes_per_s": sent / took,
            "lag_p50_s": p(0.5), "lag_p99_s": p(0.99), "lag_max_s": lags[-1] if lags else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="postgresql://cellstream:cellstream@127.0.0.1:5433/postgres")
    parser.add_argument("--store-server", default="mysql://cellstream:cellstream@127.0.0.1:3306")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--writes", type=int, default=1000, help="source writes a second while the lag is measured")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    r = run(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(r, indent=2) + "\n")
    for i, x in enumerate(r["rounds"], 1):
        print(f"round {i} ({r['rows']} rows, {r['shards']} shards): raw pipeline {x['raw_s']:.1f} s, migration "
              f"{x['mover_s']:.1f} s ({x['rows_per_s']:,.0f} rows/s), ratio {x['ratio']:.2f}")
    print(f"copy vs raw {r['ratio']:.2f} (target >= 0.7: {'met' if r['ratio'] >= 0.7 else 'MISSED'}); change lag at "
          f"{r['writes_per_s']:.0f} writes/s ({r['sent']} sent, {r['changes']} stored): "
          f"p50 {r['lag_p50_s'] * 1000:.0f} ms, p99 {r['lag_p99_s'] * 1000:.0f} ms, "
          f"max {r['lag_max_s'] * 1000:.0f} ms (target p99 <= 1 s: "
          f"{'met' if r['lag_p99_s'] <= 1.0 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
