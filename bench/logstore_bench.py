"""logstore against raw pymysql doing the same work, in one run, on the same MariaDB.

    python bench/logstore_bench.py [--server URL] [--cells N] [--shards S] [--rss-cells N]

The raw side writes and reads ONE table of the same shape as a node's ``cells``
table (the seed's columns plus the shard, the same unique and created_at keys, the
same MessagePack+zlib bodies), with a plain AUTO_INCREMENT id and no ordering
guarantee, so a ratio is the price of logstore's guarantees (validation, per-shard
counters and locks, the shard-clustered log, Cell records), nothing else. The
instance has the default 4096 shards unless ``--shards`` says otherwise.
Throughput ratios are project/raw (higher is better); latency ratios project/raw
(lower is better).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pymysql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.scratch import drop_database
from logstore.backends.mysql.target import MySQLTarget
from logstore.cell import decode_body, shard_of
from logstore.config import parse_node_url
from tests.harness.shared_servers import MYSQL_SERVER as SERVER


def trip_body(i: int) -> dict[str, Any]:
    return {
        "city_uuid": str(uuid.UUID(int=i % 97)), "driver_partner_uuid": str(uuid.UUID(int=i % 1009)),
        "rider_uuid": str(uuid.UUID(int=i)), "trip_created_at": 1_700_000_000 + i, "fare": round(5 + i % 50 * 0.75, 2),
        "currency": "EUR", "distance_km": (i % 300) / 10, "product": "uberX", "is_pool": i % 7 == 0,
        "route": [[55.67 + (i % 10) / 1000, 12.56 + (i % 13) / 1000] for _ in range(3)],
    }


def encode(body: dict[str, Any]) -> bytes:
    return b"\x01" + zlib.compress(msgpack.packb(body, use_bin_type=True), 6)


def connect(url: str) -> pymysql.connections.Connection:
    t = parse_node_url(url)
    assert isinstance(t, MySQLTarget)
    return pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password, database=t.database,
                           autocommit=True, binary_prefix=True)


RAW_TABLE = (
    "CREATE TABLE IF NOT EXISTS raw_single ("
    " added_id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, shard INT NOT NULL, row_key BINARY(16) NOT NULL,"
    " column_name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, ref_key BIGINT NOT NULL,"
    " body LONGBLOB NOT NULL, created_at DATETIME(6) NOT NULL,"
    " UNIQUE KEY cell (row_key, column_name, ref_key), KEY created (shard, created_at)) ENGINE=InnoDB"
)
RAW_INSERT = "INSERT INTO raw_single (shard, row_key, column_name, ref_key, body, created_at) VALUES "


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Bench:
    def __init__(self, url: str, shards: int) -> None:
        self.url = url
        self.shards = shards
        self.store = logstore.open(url, shards=shards)
        self.raw = connect(url)
        with self.raw.cursor() as cur:
            cur.execute(RAW_TABLE)
        self.results: dict[str, Any] = {}

    def rows(self, n: int, offset: int) -> list[tuple[uuid.UUID, str, int, dict[str, Any]]]:
        return [(uuid.uuid4(), "BASE", 1, trip_body(offset + i)) for i in range(n)]

    # -- 1. batched puts ------------------------------------------------------------
    def raw_put_one_table(self, batch: list[tuple[uuid.UUID, str, int, dict[str, Any]]]) -> None:
        rows = [(shard_of(key, self.shards), key.bytes, column, ref, encode(body)) for key, column, ref, body in batch]
        with self.raw.cursor() as cur:
            values = ", ".join(["(%s, %s, %s, %s, %s, UTC_TIMESTAMP(6))"] * len(rows))
            cur.execute("START TRANSACTION")
            cur.execute(RAW_INSERT + values, [a for r in rows for a in r])
            cur.execute("COMMIT")

    def batched_puts(self, cells: int, batch: int) -> None:
        rounds = 4
        totals = {"project": 0.0, "raw": 0.0}
        sides: list[tuple[str, Callable[[list[Any]], Any]]] = [
            ("project", self.store.put_cells), ("raw", self.raw_put_one_table)]
        for r in range(rounds):
            for name, put in sides if r % 2 == 0 else sides[::-1]:
                data = self.rows(cells, r * cells)
                batches = [data[i:i + batch] for i in range(0, len(data), batch)]
                totals[name] += timed(lambda put=put, batches=batches: [put(b) for b in batches])  # type: ignore[misc]
        project, raw = totals["project"], totals["raw"]
        n = rounds * cells
        self.results["batched_put"] = {
            "project_cells_per_s": n / project, "raw_cells_per_s": n / raw, "ratio": raw / project,
            "target": ">= 0.8", "batch": batch, "shards": self.shards,
        }

    # -- 2. log scan --------------------------------------------------------------------
    def log_scan(self) -> None:
        def project() -> int:
            # As a tailer reads: the shards' cell counts first (one read), then queries of many shards, each
            # reserving about a page (1,000 cells) as the raw side's page, until every count is read.
            left = {info.shard: info.cells for info in self.store.shard_stats() if info.cells}
            locations = dict.fromkeys(left, 0)
            n = 0
            while left:
                group: dict[int, int] = {}
                reserved = 0
                for shard, cells in left.items():
                    group[shard] = locations[shard]
                    reserved += min(cells, 1000)
                    if reserved >= 1000:
                        break
                for shard, page in self.store.get_cells_for_shards(group, 1000).items():
                    assert isinstance(page, list) and page
                    locations[shard] = page[-1].added_id
                    n += len(page)
                    left[shard] -= len(page)
                    if left[shard] <= 0:
                        del left[shard]
            return n

        def raw() -> int:
            n = 0
            with self.raw.cursor() as cur:
                location = 0
                while True:
                    cur.execute("SELECT added_id, shard, row_key, column_name, ref_key, body, created_at"
                                " FROM raw_single WHERE added_id > %s ORDER BY added_id LIMIT 1000", (location,))
                    rows = cur.fetchall()
                    if not rows:
                        break
                    for row in rows:
                        decode_body(row[5])
                    location = rows[-1][0]
                    n += len(rows)
            return n

        counts: dict[str, int] = {}
        best = {"project": float("inf"), "raw": float("inf")}
        for r in range(4):
            sides = (("project", project), ("raw", raw))
            for name, fn in sides if r % 2 == 0 else sides[::-1]:
                start = time.perf_counter()
                counts[name] = fn()
                best[name] = min(best[name], time.perf_counter() - start)
        assert counts["project"] == counts["raw"], counts
        n = counts["project"]
        self.results["log_scan"] = {
            "cells": n, "project_cells_per_s": n / best["project"], "raw_cells_per_s": n / best["raw"],
            "ratio": best["raw"] / best["project"], "target": ">= 0.8",
        }

    # -- 3. point reads -------------------------------------------------------------------
    def latest_reads(self, lookups: int) -> None:
        pages = self.store.get_cells_for_shards(dict.fromkeys(range(self.shards), 0), 200)
        keys = [c.row_key for page in pages.values() if isinstance(page, list) for c in page]
        with self.raw.cursor() as cur:
            cur.execute("SELECT row_key FROM raw_single")
            raw_keys = [uuid.UUID(bytes=k) for (k,) in cur.fetchall()]
        rng = random.Random(5)
        pairs = list(zip(rng.sample(keys, lookups), rng.sample(raw_keys, lookups), strict=True))
        with self.raw.cursor() as cur:
            def raw(pair: tuple[uuid.UUID, uuid.UUID]) -> None:
                cur.execute("SELECT added_id, shard, row_key, column_name, ref_key, body, created_at FROM raw_single"
                            " WHERE row_key = %s AND column_name = %s ORDER BY ref_key DESC LIMIT 1",
                            (pair[1].bytes, "BASE"))
                found = cur.fetchone()
                assert found is not None
                decode_body(found[5])

            samples = alternate(pairs, lambda pair: self.store.get_cell_latest(pair[0], "BASE"), raw)
        self.results["get_cell_latest"] = latency(*samples, "<= 1.3")

    # -- 4. durable single puts ----------------------------------------------------------------
    def single_puts(self, count: int) -> None:
        with self.raw.cursor() as cur:
            def raw(i: int) -> None:
                key = uuid.uuid4()
                cur.execute(RAW_INSERT + "(%s, %s, %s, %s, %s, UTC_TIMESTAMP(6))",
                            (shard_of(key, self.shards), key.bytes, "BASE", 1, encode(trip_body(i))))

            samples = alternate(range(count), lambda i: self.store.put_cell(uuid.uuid4(), "BASE", 1, trip_body(i)), raw)
        self.results["single_put"] = latency(*samples, "<= 1.3")

    def close(self) -> None:
        self.store.close()
        self.raw.close()


def alternate(items: Any, project: Callable[[Any], Any], raw: Callable[[Any], Any]) -> tuple[list[float], list[float]]:
    """Time both sides on every item, swapping which goes first (ABBA), so drift and warm caches hit both alike."""
    times: dict[str, list[float]] = {"project": [], "raw": []}
    for i, item in enumerate(items):
        order = (("project", project), ("raw", raw)) if i % 2 else (("raw", raw), ("project", project))
        for name, fn in order:
            start = time.perf_counter()
            fn(item)
            times[name].append(time.perf_counter() - start)
    return times["project"], times["raw"]


def latency(project: list[float], raw: list[float], target: str) -> dict[str, Any]:
    p50, r50 = statistics.median(project), statistics.median(raw)
    return {
        "project_p50_ms": p50 * 1e3, "raw_p50_ms": r50 * 1e3, "ratio_p50": p50 / r50,
        "project_p99_ms": percentile(project, 0.99) * 1e3, "raw_p99_ms": percentile(raw, 0.99) * 1e3,
        "samples": len(project), "target": target,
    }


def open_figures(server: str) -> dict[str, float]:
    url = f"{server}/csbench_open_{uuid.uuid4().hex[:8]}"
    created = timed(lambda: logstore.open(url).close())
    reopened = timed(lambda: logstore.open(url).close())
    drop_database(url)
    return {"create_4096_shards_s": created, "reopen_4096_shards_s": reopened}


def rss_paging(url: str, cells: int) -> dict[str, Any]:
    """Load ``cells`` into a one-shard instance, then page it in a fresh process and read its peak RSS."""
    with logstore.open(url, shards=1) as store:
        have = store.head(0)
        start = time.perf_counter()
        batch = 2000
        i = 0
        while store.shard_stats()[0].cells < cells:
            store.put_cells([(uuid.uuid4(), "BASE", 1, trip_body(i + j)) for j in range(batch)])
            i += batch
            if i % 100_000 == 0:
                print(f"  loaded {i} cells", file=sys.stderr, flush=True)
        load_s = time.perf_counter() - start
        total = store.shard_stats()[0].cells
    code = (
        "import logstore, sys, time\n"
        f"s = logstore.open({url!r})\n"
        "n, loc, t = 0, 0, time.perf_counter()\n"
        "while True:\n"
        "    cells, loc = s.get_cells_for_shard(0, loc, 1000)\n"
        "    if not cells: break\n"
        "    n += len(cells)\n"
        # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would count the forked parent.
        "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(n, hwm, time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.split()
    paged, rss_kb, seconds = int(out[0]), int(out[1]), float(out[2])
    assert paged == total, (paged, total)
    return {"cells": paged, "peak_rss_mb": rss_kb / 1024, "page_s": seconds, "load_s": load_s,
            "preloaded": have, "target": "< 200 MB"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=SERVER, help="MariaDB server URL without database")
    parser.add_argument("--cells", type=int, default=20_000, help="cells per batched-put round")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--lookups", type=int, default=3000)
    parser.add_argument("--puts", type=int, default=1000)
    parser.add_argument("--rss-cells", type=int, default=1_000_000)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "logstore.json"))
    args = parser.parse_args()

    url = f"{args.server.rstrip('/')}/csbench_{uuid.uuid4().hex[:8]}"
    rss_url = f"{args.server.rstrip('/')}/csbench_rss_{uuid.uuid4().hex[:8]}"
    bench = Bench(url, args.shards)
    try:
        print(f"batched puts: 4 x {args.cells} cells in batches of {args.batch} into {args.shards} shards",
              file=sys.stderr)
        bench.batched_puts(args.cells, args.batch)
        print("log scan of every shard, queries of about 1000 cells as a tailer reads", file=sys.stderr)
        bench.log_scan()
        print(f"get_cell_latest x {args.lookups}", file=sys.stderr)
        bench.latest_reads(args.lookups)
        print(f"durable single puts x {args.puts}", file=sys.stderr)
        bench.single_puts(args.puts)
        results = bench.results
    finally:
        bench.close()
        drop_database(url)
    results["open"] = open_figures(args.server.rstrip("/"))
    if args.rss_cells:
        print(f"paging a {args.rss_cells}-cell shard (loading first)", file=sys.stderr)
        try:
            results["paging_rss"] = rss_paging(rss_url, args.rss_cells)
        finally:
            drop_database(rss_url)
    results["max_rss_of_bench_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    report(results)
    return 0


def report(r: dict[str, Any]) -> None:
    bp, ls, gl, sp = r["batched_put"], r["log_scan"], r["get_cell_latest"], r["single_put"]
    print(f"\n{'measure':<34}{'logstore':>14}{'raw pymysql':>14}{'ratio':>8}  target")
    print(f"shards: {bp['shards']}")
    print(f"{'batched put (cells/s)':<34}{bp['project_cells_per_s']:>14.0f}{bp['raw_cells_per_s']:>14.0f}"
          f"{bp['ratio']:>8.2f}  {bp['target']} x raw")
    print(f"{'log scan + decode (cells/s)':<34}{ls['project_cells_per_s']:>14.0f}{ls['raw_cells_per_s']:>14.0f}"
          f"{ls['ratio']:>8.2f}  {ls['target']} x raw")
    print(f"{'get_cell_latest p50 (ms)':<34}{gl['project_p50_ms']:>14.3f}{gl['raw_p50_ms']:>14.3f}"
          f"{gl['ratio_p50']:>8.2f}  {gl['target']} x raw")
    print(f"{'get_cell_latest p99 (ms)':<34}{gl['project_p99_ms']:>14.3f}{gl['raw_p99_ms']:>14.3f}")
    print(f"{'durable single put p50 (ms)':<34}{sp['project_p50_ms']:>14.3f}{sp['raw_p50_ms']:>14.3f}"
          f"{sp['ratio_p50']:>8.2f}  {sp['target']} x raw")
    print(f"{'durable single put p99 (ms)':<34}{sp['project_p99_ms']:>14.3f}{sp['raw_p99_ms']:>14.3f}")
    o = r["open"]
    print(f"create / reopen a 4096-shard instance: {o['create_4096_shards_s']:.2f} s / "
          f"{o['reopen_4096_shards_s']:.2f} s")
    if "paging_rss" in r:
        p = r["paging_rss"]
        print(f"paging a {p['cells']}-cell shard: peak RSS {p['peak_rss_mb']:.0f} MB (target {p['target']}), "
              f"{p['cells'] / p['page_s']:.0f} cells/s; loading it took {p['load_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
