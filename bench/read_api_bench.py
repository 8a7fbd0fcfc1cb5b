"""The read API (issue 54) against the reads it replaces and the raw SELECTs it is made of, in one run, on
MariaDB and on SQLite.

    python bench/read_api_bench.py [--server URL] [--shards S] [--rows N] [--rounds R] [--json FILE]

- **Batched read**: ``Store.get_cells`` of 100 coordinates against 100 ``Store.get_cell`` (target: >= 5x), and
  ``get_cells_latest`` against 100 ``get_cell_latest``. Coordinates are spread over the instance's shards.
- **Versions**: the 1,000 versions of one cell paged 100 at a time with ``Store.get_cell_versions`` (11 reads:
  the last one empty) against the same 11 SELECTs run with pymysql / sqlite3 on the same table and index
  (target: <= 2x). The raw side decodes each body (zlib, MessagePack) as the store does, so both give the
  same dicts; the raw SELECTs' time without decoding is printed too.

Every figure is the median of ``--rounds`` rounds, the two sides alternating within a round (a round's
coordinates read once untimed first, so that neither side pays for reading their pages in). The instance
has 4096 shards unless ``--shards`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pymysql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.scratch import scratch_database
from logstore.backends.mysql.target import MySQLTarget
from logstore.cell import decode_body
from logstore.config import parse_node_url
from tests.harness.shared_servers import MYSQL_SERVER as SERVER
from tests.harness.stores import sqlite_file

VERSIONS, PAGE, BATCH = 1000, 100, 100


def body(i: int) -> dict[str, Any]:
    return {"rider_uuid": str(uuid.UUID(int=i)), "fare": round(5 + i % 50 * 0.75, 2), "currency": "EUR",
            "distance_km": (i % 300) / 10, "product": "uberX", "route": [[55.67, 12.56 + (i % 13) / 1000]] * 3}


def timed(fn: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def one_by_one(read: Callable[..., Any], coordinates: list[tuple[Any, ...]]) -> None:
    for coordinate in coordinates:
        read(*coordinate)


@contextmanager
def instance(kind: str, server: str, shards: int) -> Iterator[tuple[str, Callable[[], Any]]]:
    """A store URL of ``kind`` and a function connecting to its one node with the raw driver."""
    if kind == "mysql":
        with scratch_database(server, "read_api") as url:
            target = parse_node_url(url)
            assert isinstance(target, MySQLTarget)
            yield url, lambda: pymysql.connect(host=target.host, port=target.port, user=target.user,
                                               password=target.password, database=target.database, autocommit=True)
    else:
        with tempfile.TemporaryDirectory() as directory:
            url = f"sqlite:///{directory}/store"
            yield url, lambda: sqlite3.connect(sqlite_file(url), isolation_level=None)


def raw_pages(conn: Any, kind: str, key: uuid.UUID, decode: bool) -> int:
    """The versions of (key, A) paged PAGE at a time with the driver: the same SELECT the store runs."""
    mark = "%s" if kind == "mysql" else "?"
    first = ("SELECT shard, added_id, row_key, column_name, ref_key, body, created_at FROM cells"
             f" WHERE row_key = {mark} AND column_name = {mark} ORDER BY ref_key DESC LIMIT {mark}")
    after = first.replace("ORDER BY", f"AND ref_key < {mark} ORDER BY")
    cur = conn.cursor()
    seen, before = 0, None
    while True:
        if before is None:
            cur.execute(first, (key.bytes, "A", PAGE))
        else:
            cur.execute(after, (key.bytes, "A", before, PAGE))
        rows = cur.fetchall()
        if not rows:
            return seen
        if decode:
            for row in rows:
                decode_body(row[5])
        seen += len(rows)
        before = rows[-1][4]


def store_pages(store: logstore.Store, key: uuid.UUID) -> int:
    seen, before = 0, None
    while page := store.get_cell_versions(key, "A", before=before, limit=PAGE):
        seen += len(page)
        before = page[-1].ref_key
    return seen


def run(kind: str, server: str, shards: int, rows: int, rounds: int) -> dict[str, Any]:
    with instance(kind, server, shards) as (url, connect), logstore.open(url, shards=shards) as store:
        keys = [uuid.uuid4() for _ in range(rows)]
        for start in range(0, rows, 2000):
            store.put_cells([(k, "A", 1, body(i)) for i, k in enumerate(keys[start:start + 2000], start)])
        versioned = uuid.uuid4()
        store.put_cells([(versioned, "A", ref, body(ref)) for ref in range(VERSIONS)])
        conn = connect()
        rng = random.Random(54)
        batches, singles, latest_batches, latest_singles = [], [], [], []
        versions, raw, raw_fetch = [], [], []
        assert store_pages(store, versioned) == raw_pages(conn, kind, versioned, True) == VERSIONS
        for _ in range(rounds):
            wanted: list[tuple[Any, ...]] = [(k, "A", 1) for k in rng.sample(keys, BATCH)]
            pairs: list[tuple[Any, ...]] = [(k, c) for k, c, _ in wanted]
            store.get_cells(wanted)  # untimed: the rows' pages in the cache for both sides, not the second only
            batches.append(timed(store.get_cells, wanted))
            singles.append(timed(one_by_one, store.get_cell, wanted))
            latest_batches.append(timed(store.get_cells_latest, pairs))
            latest_singles.append(timed(one_by_one, store.get_cell_latest, pairs))
            versions.append(timed(store_pages, store, versioned))
            raw.append(timed(raw_pages, conn, kind, versioned, True))
            raw_fetch.append(timed(raw_pages, conn, kind, versioned, False))
        conn.close()
    med = {name: statistics.median(samples) for name, samples in (
        ("batch", batches), ("singles", singles), ("latest_batch", latest_batches), ("latest_singles", latest_singles),
        ("versions", versions), ("raw", raw), ("raw_fetch", raw_fetch))}
    return {"backend": kind, "shards": shards, "rows": rows, "rounds": rounds,
            **{f"{k}_ms": round(v * 1000, 3) for k, v in med.items()},
            "batch_speedup": round(med["singles"] / med["batch"], 2),
            "latest_batch_speedup": round(med["latest_singles"] / med["latest_batch"], 2),
            "versions_vs_raw": round(med["versions"] / med["raw"], 2),
            "versions_vs_raw_fetch": round(med["versions"] / med["raw_fetch"], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=SERVER, help="a mysql:// URL without a database")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--backends", default="mysql,sqlite")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    results = []
    for kind in args.backends.split(","):
        result = run(kind, args.server, args.shards, args.rows, args.rounds)
        results.append(result)
        print(f"{kind} ({result['shards']} shards): batched read of {BATCH}: {result['batch_ms']} ms against "
              f"{BATCH} get_cell {result['singles_ms']} ms -> x{result['batch_speedup']} (target >= 5); latest: "
              f"{result['latest_batch_ms']} ms against {result['latest_singles_ms']} ms -> "
              f"x{result['latest_batch_speedup']}")
        print(f"{kind}: {VERSIONS} versions by {PAGE}: {result['versions_ms']} ms against raw SELECTs "
              f"{result['raw_ms']} ms (decoding bodies; {result['raw_fetch_ms']} ms without) -> "
              f"{result['versions_vs_raw']}x (target <= 2; {result['versions_vs_raw_fetch']}x the fetch alone)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
