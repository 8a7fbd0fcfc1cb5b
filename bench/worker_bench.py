"""Worker node benchmark (issue 7): python bench/worker_bench.py [--rate R] [--clients C] [--seconds T] [--shards N].

On MariaDB (a fresh database of ``--shards`` shards, default 4096, the store's default), with ``--cells``
cells written first:

1. direct: ``clients`` threads, each with its own pymysql connection, run get_cell_latest's query (the
   ``SELECT ... ORDER BY ref_key DESC LIMIT 1`` of logstore.backends.mysql.recorder on the node's ``cells`` table) at
   ``rate`` per second in all;
2. worker reads: ``cellstream serve`` in its own process in front of the same store; ``clients``
   keep-alive connections (this process, uvloop, a minimal HTTP/1.1 client like wrk's) GET
   ``/v1/rows/{row_key}/{column}`` at ``rate`` per second in all;
3. worker puts: the same clients PUT new cells at ``rate`` per second.

Each client sends on a fixed schedule (its share of the rate), a request's latency is from its send to
the end of its answer, after a warm-up of ``--warmup`` seconds at the same rate that is not
measured; p50 and p99 are printed with the achieved rate, and the worker's peak RSS
(psutil) while under load. Targets: worker get_cell_latest p50 <= 2 ms, p99 <= 10 ms; RSS < 150 MB.
Results go to bench/results/worker.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil  # type: ignore[import-untyped]
import pymysql
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.scratch import served
from logstore.backends.mysql.target import MySQLTarget
from logstore.config import parse_node_url
from tests.harness.shared_servers import MYSQL_SERVER as SERVER


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(latencies: list[float], seconds: float) -> dict[str, float]:
    ms = [x * 1000 for x in latencies]
    return {"requests": len(ms), "achieved_per_s": round(len(ms) / seconds, 1),
            "p50_ms": round(statistics.median(ms), 3), "p90_ms": round(percentile(ms, 0.9), 3),
            "p99_ms": round(percentile(ms, 0.99), 3),
            "max_ms": round(max(ms), 3)}


# -- 1. direct ---------------------------------------------------------------------------
def direct(url: str, keys: list[tuple[uuid.UUID, int]], rate: float, clients: int, seconds: float,
           warmup: float) -> list[float]:
    target = parse_node_url(url)
    assert isinstance(target, MySQLTarget)
    latencies: list[float] = []
    lock = threading.Lock()
    start = time.perf_counter() + 0.5 + warmup

    def client(i: int) -> None:
        conn = pymysql.connect(host=target.host, port=target.port, user=target.user, password=target.password,
                               database=target.database, autocommit=True)
        mine: list[float] = []
        period, n = clients / rate, 0
        at = start - warmup + i * (1 / rate)
        try:
            with conn.cursor() as cur:
                while at < start + seconds:
                    time.sleep(max(0.0, at - time.perf_counter()))
                    key, _shard = keys[(i + n * clients) % len(keys)]
                    sent = time.perf_counter()
                    cur.execute("SELECT shard, added_id, row_key, column_name, ref_key, body, created_at FROM "
                                "cells WHERE row_key = %s AND column_name = %s "
                                "ORDER BY ref_key DESC LIMIT 1", (key.bytes, "BASE"))
                    assert cur.fetchone() is not None
                    if sent >= start:
                        mine.append(time.perf_counter() - sent)
                    n += 1
                    at += period
        finally:
            conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


# -- 2 and 3. through the worker node ---------------------------------------------------------
class _Client:
    """One keep-alive HTTP/1.1 connection that sends prepared requests and reads answers by Content-Length:
    a load generator as light as wrk's, so the latencies are the node's rather than a client library's."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, base: str) -> _Client:
        parts = urlsplit(base)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, f"{parts.hostname}:{parts.port}")

    async def call(self, method: str, path: str, body: bytes = b"") -> int:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return int(status_line.split()[1])

    def close(self) -> None:
        self.writer.close()


async def through_node(base: str, keys: list[tuple[uuid.UUID, int]], rate: float, clients: int, seconds: float,
                       warmup: float, put: bool, worker: psutil.Process) -> tuple[list[float], float]:
    latencies: list[float] = []
    peak = 0.0
    connections = [await _Client.open(base) for _ in range(clients)]
    start = time.perf_counter() + 0.5 + warmup
    done = asyncio.Event()

    async def client(i: int) -> None:
        period, n = clients / rate, 0
        at = start - warmup + i * (1 / rate)
        conn = connections[i]
        while at < start + seconds:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            sent = time.perf_counter()
            if put:
                status = await conn.call("PUT", f"/v1/rows/{uuid.uuid4()}/TRIP/1",
                                         json.dumps({"client": i, "n": n, "fare": 12.5}).encode())
            else:
                status = await conn.call("GET", f"/v1/rows/{keys[(i + n * clients) % len(keys)][0]}/BASE")
            assert status == 200, status
            if sent >= start:
                latencies.append(time.perf_counter() - sent)
            n += 1
            at += period

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, worker.memory_info().rss / 2**20)
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(client(i) for i in range(clients)))
    done.set()
    await sampler
    for conn in connections:
        conn.close()
    return latencies, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cells", type=int, default=20_000)
    parser.add_argument("--shards", type=int, default=4096, help="shards of the store (default 4096, the store's)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds at the rate before measuring")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of rest after writing the cells")
    parser.add_argument("--mysql", default=SERVER, help="a mysql:// server URL without a database")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "worker.json"))
    args = parser.parse_args(argv)
    database = f"csbench_{uuid.uuid4().hex[:8]}"
    url = f"{args.mysql.rstrip('/')}/{database}"
    admin_target = parse_node_url(url)
    assert isinstance(admin_target, MySQLTarget)
    admin = pymysql.connect(host=admin_target.host, port=admin_target.port, user=admin_target.user,
                            password=admin_target.password, autocommit=True)
    try:
        with logstore.open(url, shards=args.shards) as store:
            keys: list[tuple[uuid.UUID, int]] = []
            for start in range(0, args.cells, 2000):
                cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"city": f"c{i % 40}", "fare": i * 0.5})
                                         for i in range(start, min(args.cells, start + 2000))])
                keys.extend((c.row_key, c.shard) for c in cells)
        time.sleep(args.settle)  # InnoDB flushes what the load dirtied: not part of any side's time
        with served(url) as (base, worker):
            process = psutil.Process(worker.pid)
            idle_rss = process.memory_info().rss / 2**20
            results: dict[str, Any] = {"rate": args.rate, "clients": args.clients, "seconds": args.seconds,
                                       "cells": args.cells, "shards": args.shards}
            lat = direct(url, keys, args.rate, args.clients, args.seconds, args.warmup)
            results["direct_pymysql_latest"] = summary(lat, args.seconds)
            lat, peak_reads = uvloop.run(through_node(base, keys, args.rate, args.clients, args.seconds,
                                                      args.warmup, False, process))
            results["worker_latest"] = summary(lat, args.seconds)
            lat, peak_puts = uvloop.run(through_node(base, keys, args.rate, args.clients, args.seconds,
                                                     args.warmup, True, process))
            results["worker_put"] = summary(lat, args.seconds)
            results["worker_rss_mb"] = {"idle": round(idle_rss, 1),
                                        "peak_under_load": round(max(peak_reads, peak_puts), 1), "target": "< 150"}
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{database}`")
        admin.close()
    w, d = results["worker_latest"], results["direct_pymysql_latest"]
    print(f"get_cell_latest at {args.rate:.0f}/s from {args.clients} clients: worker p50 {w['p50_ms']} ms, "
          f"p99 {w['p99_ms']} ms ({w['achieved_per_s']}/s); direct pymysql p50 {d['p50_ms']} ms, "
          f"p99 {d['p99_ms']} ms; targets p50 <= 2 ms: {'met' if w['p50_ms'] <= 2 else 'MISSED'}, "
          f"p99 <= 10 ms: {'met' if w['p99_ms'] <= 10 else 'MISSED'}")
    p = results["worker_put"]
    print(f"put through the worker: p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms ({p['achieved_per_s']}/s)")
    rss = results["worker_rss_mb"]
    print(f"worker RSS: {rss['idle']} MB idle, {rss['peak_under_load']} MB peak under load "
          f"(target < 150 MB: {'met' if rss['peak_under_load'] < 150 else 'MISSED'})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
