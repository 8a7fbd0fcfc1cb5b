"""Secondary-index benchmark (issue 5): python bench/index_bench.py [--store URL | --mysql] [--shards N].

Each figure is compared with the raw library doing the same work in the same run on the same database:
sqlite3 on the node's index file (WAL, synchronous=FULL, BEGIN IMMEDIATE) or pymysql (READ COMMITTED like
the store). Cells are trips for the seed's driver_partner_index (driver uuid = shard field, city uuid,
trip_created_at, fare): ~125 per driver in 2-3 of 8 cities over 30 days, one in ten a fare correction
(ref_key 2) of an earlier trip.

1. Apply throughput per worker: ``--cells`` cells are put and read back in batches of up to ``--batch``
   consecutive cells of one source shard (the runtime's grouping: with 64 shards, a shard's whole share;
   with the default 4096, about a dozen cells); one thread applies them with ``store.indexes.apply``
   (positions, locators, entries; a transaction per batch) against raw executemany upserts of the same
   rows committed per batch: same encoding (uuid as 16 bytes, datetime as int micros), the library's own
   entry-table DDL (primary key (shard, row_key), the query index) and the same ref_key-guarded upsert.
   ``--rounds`` rounds on fresh tables, alternating which side goes first; both tables must end with the
   same rows. Target: index/raw >= 0.6.
2. Index lag at ``--rate`` cells/s: the app keeping the index runs in its own process (direct mode,
   start_from="now"); once it has claimed every shard, 8 writer threads here put trips for ``--seconds``
   (bench/pacing.py). A cell's lag runs from its put_cell's return to the return of the app's
   IndexApplier.apply of its batch (entry committed), recorded by wrapping that method; the warm-up tenth
   is dropped. Targets: p50 <= 20 ms, p99 <= 200 ms.
3. Single-shard query p50: after a backfill and activation, ``--queries`` queries ``Index.query(
   driver_partner_uuid=d, city_uuid=c, trip_created_at=(start, end), limit=100)`` against the same SELECT
   on the entry table through the raw library, rows decoded to the same values; each pair alternates
   which goes first and must return the same row_keys. Target: index/raw p50 <= 1.5. Before the queries,
   ``cellstream index verify`` checks that the index equals the cells (none may differ) and is timed.

Results: bench/results/index.json (MariaDB: index_mysql.json) or ``--out``. Store: a fresh SQLite
directory; ``--store`` a mysql:// URL of an empty database; ``--mysql`` a fresh database on
$CELLSTREAM_TEST_MYSQL, dropped afterwards. The store has ``--shards`` shards (default 4096, the store's
default).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import hashlib
import itertools
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pymysql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.pacing import latencies, paced_puts
from bench.scratch import drop_database
from indexer import App
from indexer.indexes.applier import Index, IndexApplier
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.definitions import IndexDefinition, load_indexes
from indexer.indexes.verify import verify
from logstore import Cell
from logstore.backends.mysql import index_tables as mysql_index
from logstore.backends.mysql.target import MySQLTarget
from logstore.backends.sqlite import index_tables as sqlite_index
from logstore.backends.sqlite.recorder import INDEX_FILE
from logstore.backends.sqlite.target import SQLiteTarget
from logstore.config import parse_node_url
from logstore.index_tables.persistence import ApplyResult, IndexChange, IndexSpec, Stream
from tests.harness.shared_servers import MYSQL_SERVER as SERVER

NAME = "driver_partner_index"
YAML = f"""indexes:
  - name: {NAME}
    column: BASE
    version: 1
    shard_field: driver_partner_uuid
    fields:
      - {{name: driver_partner_uuid, type: uuid, key: true}}
      - {{name: city_uuid, type: uuid, key: true}}
      - {{name: trip_created_at, type: datetime, key: true}}
      - {{name: fare, type: float}}
"""
FIELDS = ("driver_partner_uuid", "city_uuid", "trip_created_at", "fare")
COLUMNS = ", ".join(("shard", "row_key", "ref_key", *FIELDS))
T0, EPOCH = dt.datetime(2026, 11, 1, tzinfo=dt.UTC), dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
ONE_US = dt.timedelta(microseconds=1)
DAYS, CITIES, TRIPS_PER_DRIVER = 30, 8, 125
READ_GROUP = 512  # shards per get_cells_for_shards call when reading the log back
Ask = tuple[uuid.UUID, uuid.UUID, dt.datetime, dt.datetime]  # a query: driver, city, [start, end)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def entry_shard(driver: bytes, shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(driver, digest_size=8).digest(), "big") % shards


class Trips:
    """Trip bodies: each driver works in 2-3 of the cities; trips spread over DAYS days."""

    def __init__(self, cells: int) -> None:
        self.rng = random.Random(5)
        cities = [uuid.UUID(int=self.rng.getrandbits(128)) for _ in range(CITIES)]
        self.drivers = [uuid.UUID(int=self.rng.getrandbits(128)) for _ in range(max(1, cells // TRIPS_PER_DRIVER))]
        self.homes = {d: self.rng.sample(cities, self.rng.choice((2, 3))) for d in self.drivers}

    def body(self, _i: int = 0) -> dict[str, Any]:
        driver = self.rng.choice(self.drivers)
        when = T0 + dt.timedelta(seconds=self.rng.uniform(0, DAYS * 86400))
        return {"driver_partner_uuid": str(driver), "city_uuid": str(self.rng.choice(self.homes[driver])),
                "trip_created_at": when.isoformat(), "fare": round(self.rng.uniform(5, 80), 2),
                "rider_uuid": str(uuid.uuid4()), "status": "completed"}

    def load(self, store: logstore.Store, cells: int) -> None:
        """Put ``cells`` cells in batches of 1000: new trips, one in ten a fare correction of an earlier one."""
        earlier: list[tuple[uuid.UUID, dict[str, Any]]] = []
        todo: list[tuple[uuid.UUID | str, str, int, dict[str, Any]]] = []
        for _ in range(cells):
            if earlier and self.rng.random() < 0.1:
                key, body = earlier.pop(self.rng.randrange(len(earlier)))
                todo.append((key, "BASE", 2, {**body, "fare": round(body["fare"] * 1.1, 2)}))
            else:
                earlier.append((uuid.uuid4(), self.body()))
                todo.append((earlier[-1][0], "BASE", 1, earlier[-1][1]))
        for start in range(0, cells, 1000):
            store.put_cells(todo[start:start + 1000])


def read_batches(store: logstore.Store, definition: IndexDefinition, size: int) -> list[list[IndexChange]]:
    """The log as the runtime batches it: consecutive cells of one source shard, shards interleaved.

    Read as a tailer reads: a page of every shard still holding cells, ``READ_GROUP`` shards a call."""
    per_shard: list[list[list[IndexChange]]] = [[] for _ in range(store.shard_count)]
    locations = dict.fromkeys(range(store.shard_count), 0)
    while locations:
        shards = list(locations)
        for start in range(0, len(shards), READ_GROUP):
            group = {s: locations[s] for s in shards[start:start + READ_GROUP]}
            for shard, cells in store.get_cells_for_shards(group, size, columns=[definition.column]).items():
                assert isinstance(cells, list), cells
                if cells:
                    per_shard[shard].append([IndexChange(c.shard, c.added_id, c.row_key, c.ref_key,
                                                         definition.entry(c.body)) for c in cells])
                    locations[shard] = cells[-1].added_id
                else:
                    del locations[shard]
    return [page for pages in itertools.zip_longest(*per_shard) for page in pages if page]


class Raw:
    """The raw library on the store's database: its own connection, hand-written SQL, the library's DDL."""

    def __init__(self, t: MySQLTarget | SQLiteTarget) -> None:
        self.mysql = isinstance(t, MySQLTarget)
        if isinstance(t, MySQLTarget):
            self.conn: Any = pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password,
                                             database=t.database, autocommit=True, binary_prefix=True)
            setup, self.mark, self.begin = ["SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"], "%s", "BEGIN"
        else:
            self.conn = sqlite3.connect(t.directory / INDEX_FILE, isolation_level=None, timeout=30)
            setup, self.mark = ["PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL"], "?"
            self.begin = "BEGIN IMMEDIATE"
        self.cur = self.conn.cursor()
        for statement in setup:
            self.execute(statement)

    def q(self, name: str) -> str:
        return f"`{name}`" if self.mysql else f'"{name}"'

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.cur.execute(sql, args)
        return list(self.cur.fetchall())

    def create(self, like: IndexSpec, version: int) -> str:
        """A plain table like the version's entry table (same DDL, query index included; no locators)."""
        spec = IndexSpec.model_validate({**like.model_dump(), "name": "bench_raw", "version": version})
        for statement in mysql_index._SQL(spec).create[:1] if self.mysql else sqlite_index._SQL(spec).create[:2]:
            self.execute(statement)
        return spec.table

    def upsert(self, table: str, batches: list[list[IndexChange]], shards: int) -> None:
        """executemany upserts of each batch's rows (pymysql sends multi-row INSERTs), one commit each."""
        t, marks = self.q(table), ", ".join([self.mark] * 7)
        if self.mysql:
            sets = ", ".join(f"{f} = IF(VALUES(ref_key) > ref_key, VALUES({f}), {f})" for f in FIELDS)
            sql = (f"INSERT INTO {t} ({COLUMNS}) VALUES ({marks}) ON DUPLICATE KEY UPDATE {sets},"
                   " ref_key = GREATEST(ref_key, VALUES(ref_key))")
        else:
            sets = ", ".join(f"{f} = excluded.{f}" for f in ("ref_key", *FIELDS))
            sql = (f"INSERT INTO {t} ({COLUMNS}) VALUES ({marks}) ON CONFLICT (shard, row_key) DO UPDATE SET {sets}"
                   f" WHERE excluded.ref_key > {t}.ref_key")
        for batch in batches:
            rows = []
            for c in batch:
                driver, v = c.values["driver_partner_uuid"].bytes, c.values
                rows.append((entry_shard(driver, shards), c.row_key.bytes, c.ref_key, driver, v["city_uuid"].bytes,
                             (v["trip_created_at"] - EPOCH) // ONE_US, v["fare"]))
            self.cur.execute(self.begin)
            self.cur.executemany(sql, rows)
            self.cur.execute("COMMIT")

    def select(self, table: str, ask: Ask, shards: int, limit: int) -> list[tuple[Any, ...]]:
        """The index query's SELECT, its rows decoded to the same Python values."""
        (driver, city, start, end), m = ask, self.mark
        rows = self.execute(
            f"SELECT {COLUMNS} FROM {self.q(table)} WHERE shard = {m} AND driver_partner_uuid = {m} AND city_uuid = {m}"
            f" AND trip_created_at >= {m} AND trip_created_at < {m} ORDER BY city_uuid, trip_created_at, row_key"
            f" LIMIT {m}", (entry_shard(driver.bytes, shards), driver.bytes, city.bytes, (start - EPOCH) // ONE_US,
                            (end - EPOCH) // ONE_US, limit))
        return [(s, uuid.UUID(bytes=k), r, uuid.UUID(bytes=d), uuid.UUID(bytes=c), EPOCH + t * ONE_US, float(f))
                for s, k, r, d, c, t, f in rows]

    def rows(self, table: str) -> list[tuple[Any, ...]]:
        return self.execute(f"SELECT {COLUMNS} FROM {self.q(table)} ORDER BY shard, row_key")


# -- 1. apply throughput ------------------------------------------------------------------------
def apply_index(store: logstore.Store, spec: IndexSpec, batches: list[list[IndexChange]]) -> ApplyResult:
    result = ApplyResult()
    for batch in batches:
        result += store.indexes.apply(spec, batch)
    return result


def apply_throughput(store: logstore.Store, raw: Raw, definition: IndexDefinition, batches: list[list[IndexChange]],
                     rounds: int) -> dict[str, Any]:
    cells, totals = sum(len(b) for b in batches), {"index": 0.0, "raw": 0.0}
    for r in range(rounds):
        spec = IndexSpec.model_validate({**definition.spec.model_dump(), "name": "bench_apply", "version": r + 1})
        store.indexes.create(spec)  # a version outside the catalog: fresh tables every round
        table = raw.create(spec, r + 1)
        sides: list[tuple[str, Callable[[], Any]]] = [
            ("index", functools.partial(apply_index, store, spec, batches)),
            ("raw", functools.partial(raw.upsert, table, batches, store.shard_count))]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            started = time.perf_counter()
            result = fn()
            totals[name] += time.perf_counter() - started
            assert name == "raw" or (result.applied + result.superseded == cells and not result.skipped), result
        assert raw.rows(spec.table) == raw.rows(table), "the index and the raw upserts hold different rows"
    index, plain = rounds * cells / totals["index"], rounds * cells / totals["raw"]
    return {"cells": cells, "batches": len(batches), "mean_batch": round(cells / len(batches)), "rounds": rounds,
            "index_cells_per_s": round(index), "raw_cells_per_s": round(plain), "ratio": round(index / plain, 3),
            "target": ">= 0.6", "met": index / plain >= 0.6}


# -- 2. index lag ----------------------------------------------------------------------------------
def serve_lag(url: str, out: str, shards: int) -> None:
    """(the app process) Keep the index until the parent's cells are applied; write {row_key: time}."""
    got: dict[str, float] = {}
    with logstore.open(url, shards=shards) as store:
        app = App("bench-index", store=store, start_from="now")
        app.index(load_indexes(YAML))
        [applier] = [t.applier for t in app.triggers if isinstance(t.applier, IndexApplier)]
        apply = applier.apply

        def timed(changes: Sequence[IndexChange], batch: Sequence[Cell] = (), *,
                  stream: Stream | None = "live") -> ApplyResult:
            """The applier's apply, then when its batch's entries were committed."""
            result = apply(changes, batch, stream=stream)
            now = time.time()
            for cell in batch:
                got.setdefault(str(cell.row_key), now)
            return result
        applier.apply = timed  # type: ignore[method-assign]

        async def scenario() -> None:
            stop = asyncio.Event()
            running = asyncio.create_task(app.run_async(stop))
            while (await asyncio.to_thread(IndexCatalog(store).get, NAME)).versions[1].live_since is None:
                assert not running.done(), running.exception()
                await asyncio.sleep(0.05)
            # Marked live once its tailer started; it claims the shards (at their heads) after that, which
            # with thousands of shards takes a while: a cell put in a shard not claimed yet would be skipped.
            while app.metrics.registry.get_sample_value("cellstream_tailer_owned_shards",
                                                        {"tailer": f"app.{app.name}"}) != store.shard_count:
                assert not running.done(), running.exception()
                await asyncio.sleep(0.05)
            Path(out + ".ready").touch()  # claimed at the heads (start_from now) and marked live
            expected, deadline, want = Path(out + ".expected"), None, set[str]()
            while not running.done() and (deadline is None or time.monotonic() < deadline):
                if expected.exists():
                    if deadline is None:
                        deadline, want = time.monotonic() + 60, set(json.loads(expected.read_text()))
                    if want.issubset(got):  # the parent's cells: any other cell the app saw does not count
                        break
                await asyncio.sleep(0.05)
            stop.set()
            await running

        asyncio.run(scenario())
        app.close()
    Path(out).write_text(json.dumps(got))


def lag(store: logstore.Store, url: str, trips: Trips, rate: int, seconds: float, tmp: str) -> dict[str, Any]:
    """Writers in this process, the app in its own (as in production: they share no GIL)."""
    out = f"{tmp}/lag.json"
    child = subprocess.Popen([sys.executable, __file__, "--serve-lag", out, "--store", url,
                              "--shards", str(store.shard_count)])
    while not Path(out + ".ready").exists():
        assert child.poll() is None, "the app process died"
        time.sleep(0.05)
    put_at = paced_puts(store, "BASE", rate, seconds, trips.body)
    Path(out + ".tmp").write_text(json.dumps(list(put_at)))
    os.replace(out + ".tmp", out + ".expected")
    assert child.wait(180) == 0, "the app process failed"
    ms = latencies(put_at, json.loads(Path(out).read_text()), "index")
    p50, p99 = percentile(ms, 0.5), percentile(ms, 0.99)
    return {"cells": len(put_at), "rate": rate, "achieved_rate": round(len(put_at) / seconds), "samples": len(ms),
            "p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "max_ms": round(max(ms), 2),
            "mean_ms": round(statistics.fmean(ms), 2), "target": "p50 <= 20 ms, p99 <= 200 ms",
            "met": p50 <= 20 and p99 <= 200}


# -- 3. single-shard queries -----------------------------------------------------------------------
def queries(store: logstore.Store, raw: Raw, trips: Trips, count: int) -> dict[str, Any]:
    started = time.perf_counter()
    built = backfill(store, NAME, 1)
    built_s = time.perf_counter() - started
    IndexCatalog(store).activate(NAME, 1)
    checked = verify(store, NAME)  # the index built live and by the backfill equals the cells
    assert checked.mismatches == [] and checked.pending == 0, checked.counts()
    index, rng, warm = Index(store, NAME), random.Random(7), count // 10
    table, asks = index.definition.spec.table, list[Ask]()
    for _ in range(warm + count):  # the first tenth warms both sides up, untimed
        driver, start = rng.choice(trips.drivers), T0 + dt.timedelta(days=rng.uniform(-1, DAYS - 3))
        asks.append((driver, rng.choice(trips.homes[driver]), start, start + dt.timedelta(days=rng.uniform(3, 15))))

    def project(ask: Ask) -> list[uuid.UUID]:
        return [e.row_key for e in index.query(driver_partner_uuid=ask[0], city_uuid=ask[1],
                                               trip_created_at=(ask[2], ask[3]), limit=100)]

    def plain(ask: Ask) -> list[uuid.UUID]:
        return [row[1] for row in raw.select(table, ask, store.shard_count, 100)]

    times: dict[str, list[float]] = {"index": [], "raw": []}
    sizes = []
    for i, ask in enumerate(asks):
        found = {}
        for name, fn in (("index", project), ("raw", plain)) if i % 2 else (("raw", plain), ("index", project)):
            begun = time.perf_counter()
            found[name] = fn(ask)
            if i >= warm:
                times[name].append(time.perf_counter() - begun)
        assert found["index"] == found["raw"], ask
        sizes.append(len(found["raw"]))
    p50, r50 = statistics.median(times["index"]) * 1e3, statistics.median(times["raw"]) * 1e3
    return {"queries": count, "mean_rows": round(statistics.fmean(sizes), 1), "index_p50_ms": round(p50, 3),
            "raw_p50_ms": round(r50, 3), "ratio_p50": round(p50 / r50, 3),
            "index_p99_ms": round(percentile(times["index"], 0.99) * 1e3, 3),
            "raw_p99_ms": round(percentile(times["raw"], 0.99) * 1e3, 3), "target": "<= 1.5", "met": p50 / r50 <= 1.5,
            "backfill": {"cells": built.cells, "applied": built.applied, "superseded": built.superseded,
                         "seconds": round(built_s, 2), "cells_per_s": round(built.cells / built_s)},
            "verify": {"rows": checked.rows, "cells": checked.cells, "mismatches": 0,
                       "seconds": round(checked.seconds, 2), "rows_per_s": round(checked.rows / checked.seconds)}}


def run(url: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    definition, trips, target = load_indexes(YAML)[0], Trips(args.cells), parse_node_url(url)
    assert isinstance(target, MySQLTarget | SQLiteTarget)
    with logstore.open(url, shards=args.shards) as store:
        raw = Raw(target)  # after the store made its directory
        try:
            trips.load(store, args.cells)
            ap = apply_throughput(store, raw, definition, read_batches(store, definition, args.batch), args.rounds)
            print(f"apply per worker ({ap['cells']} cells, batches of ~{ap['mean_batch']}): index "
                  f"{ap['index_cells_per_s']} cells/s; raw upserts {ap['raw_cells_per_s']} cells/s; ratio "
                  f"{ap['ratio']} (target >= 0.6: {verdict(ap['met'])})", flush=True)
            la = lag(store, url, trips, args.rate, args.seconds, tmp)
            print(f"index lag at {args.rate} cells/s ({la['achieved_rate']}/s put): p50 {la['p50_ms']} ms "
                  f"({verdict(la['p50_ms'] <= 20)} <= 20), p99 {la['p99_ms']} ms ({verdict(la['p99_ms'] <= 200)} "
                  f"<= 200), max {la['max_ms']} ms", flush=True)
            qu = queries(store, raw, trips, args.queries)
            print(f"single-shard query p50 ({qu['mean_rows']} rows): index {qu['index_p50_ms']} ms; raw SELECT "
                  f"{qu['raw_p50_ms']} ms; ratio {qu['ratio_p50']} (target <= 1.5: {verdict(qu['met'])}); backfill "
                  f"{qu['backfill']['cells_per_s']} cells/s; verify {qu['verify']['rows_per_s']} rows/s, "
                  "no mismatch", flush=True)
        finally:
            raw.conn.close()
    return {"store": "mysql" if raw.mysql else "sqlite", "shards": args.shards, "apply": ap, "lag": la, "query": qu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="a mysql:// URL of an empty database (default: a fresh SQLite directory)")
    parser.add_argument("--mysql", action="store_true", help="a fresh database on $CELLSTREAM_TEST_MYSQL")
    parser.add_argument("--shards", type=int, default=4096, help="shards of the store (default 4096, the store's)")
    for flag, default in (("--cells", 50_000), ("--batch", 1000), ("--rounds", 4), ("--rate", 1000),
                          ("--seconds", 10.0), ("--queries", 2000)):
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--out", help="default bench/results/index.json (MariaDB: index_mysql.json)")
    parser.add_argument("--serve-lag", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_lag:
        serve_lag(args.store, args.serve_lag, args.shards)
        return 0
    with tempfile.TemporaryDirectory(prefix="cellstream-bench-") as tmp:
        url = args.store or (f"{SERVER.rstrip('/')}/csbench_index_{uuid.uuid4().hex[:8]}" if args.mysql
                             else f"sqlite:///{tmp}/store")
        try:
            result = run(url, args, tmp)
        finally:
            if args.mysql:
                drop_database(url)
    name = "index_mysql.json" if result["store"] == "mysql" else "index.json"
    out = Path(args.out or Path(__file__).with_name("results") / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
