"""What a sampled diff costs the source (issue 53, "Benchmarks": a sampled diff at 1% adds <= 5% to the source's
load, measured as the workload's p99 with and without it).

    python bench/migration_diff_load_bench.py [--source URL] [--store-server URL] [--shards 4096]
                                              [--rows 200000] [--writes 1000] [--seconds 15] [--rounds 3]
                                              [--sample 0.01] [--diff-rate ROWS/S] [--pin]

A table of ``--rows`` rows in a fresh database of the PostgreSQL at ``--source``, copied once into a store of
``--shards`` shards on the MariaDB at ``--store-server``. Then a workload updates random rows at ``--writes`` a
second (autocommit, one connection), timing each statement, in windows of ``--seconds``: in each round one window
without a diff and one with ``migrate diff --sample`` running back to back in a process of its own (the order
alternating from round to round; ``--diff-rate`` is the diff's ``--rate``). Printed: each window's p50/p99, each
round's ratio of p99 with / without, the median ratio, and the diffs' rows compared. ``--pin`` gives the source
its own CPU (the PostgreSQL server and the workload on CPU 0, the store's MariaDB and the diff on CPU 1, put back
at the end), as a source on its own host has: without it, the store's reads share the source's cores. Written to
``bench/results/migration_diff_load.json``. Everything made is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
import pymysql

import logstore
from bench.migration_bench import drop_source, paced, source_table
from bench.migration_bench import spec_for as trips_spec
from bench.scratch import drop_database
from connectors.migration.diff import diff
from connectors.migration.mover import Mover
from connectors.migration.opening import open_source
from connectors.migration.spec import MigrationSpec

RESULTS = Path(__file__).resolve().parent / "results" / "migration_diff_load.json"


def spec_for(url: str, name: str) -> MigrationSpec:
    return trips_spec(url, name, base="id, rider, fare")


def workload(url: str, writes: int, seconds: float, rows: int) -> list[float]:
    """Each update's latency (seconds), sent at ``writes`` a second for ``seconds``."""
    latencies: list[float] = []
    with psycopg.connect(url, autocommit=True) as conn:
        for sent in paced(writes, seconds):
            t0 = time.perf_counter()
            conn.execute("UPDATE trips SET fare = fare + 0.01 WHERE id = %s", (1 + (sent * 7919) % rows,))
            latencies.append(time.perf_counter() - t0)
    return latencies


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid``, and of its children (a PostgreSQL server's backends), on ``cpus``."""
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)
    for child in children:
        pin(child, cpus)


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def server_pids(url: str, store_server: str) -> tuple[int, int]:
    """The PostgreSQL postmaster's pid and the MariaDB server's."""
    with psycopg.connect(url) as conn:
        [(backend,)] = conn.execute("SELECT pg_backend_pid()").fetchall()
        postmaster = _parent(Path(f"/proc/{backend}"))  # while the backend lives
    parts = urlsplit(store_server)
    conn2 = pymysql.connect(host=parts.hostname, port=parts.port or 3306, user=parts.username,
                            password=parts.password or "")
    try:
        with conn2.cursor() as cur:
            cur.execute("SELECT @@pid_file")
            [(pid_file,)] = cur.fetchall()
    finally:
        conn2.close()
    assert postmaster is not None
    return postmaster, int(Path(pid_file).read_text().split()[0])


def diff_loop(url: str, name: str, store_url: str, sample: float, rate: float | None, stop: Any, done: Any,
              cpus: set[int] | None) -> None:
    """Sampled diffs, back to back, until ``stop`` is set; ``done`` counts the diffs and rows compared."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    spec = spec_for(url, name)
    with logstore.open(store_url) as store:
        source = open_source(spec, capture=False)
        try:
            while not stop.is_set():
                report = diff(spec, source, store, sample=sample, rate=rate)
                with done.get_lock():
                    done[0] += 1
                    done[1] += report.rows
        finally:
            source.close()


class DiffLoop:
    """:func:`diff_loop` in a process of its own, as an operator's `migrate diff` runs (a thread would take the
    workload's interpreter lock and time that, not the source)."""

    def __init__(self, url: str, name: str, store_url: str, sample: float, rate: float | None,
                 cpus: set[int] | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.done = context.Array("q", 2)
        self.process = context.Process(target=diff_loop, args=(url, name, store_url, sample, rate, self.stop,
                                                              self.done, cpus), daemon=True)

    def start(self) -> None:
        self.process.start()
        time.sleep(3.0)  # the interpreter's start and the store's open are not the diff's load

    def join(self) -> None:
        self.process.join()

    @property
    def diffs(self) -> int:
        return int(self.done[0])

    @property
    def rows(self) -> int:
        return int(self.done[1])


def window(url: str, args: argparse.Namespace, loop: DiffLoop | None) -> dict[str, Any]:
    if loop is not None:
        loop.start()
    try:
        lat = sorted(workload(url, args.writes, args.seconds, args.rows))
    finally:
        if loop is not None:
            loop.stop.set()
            loop.join()

    def p(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))]
    return {"diff": loop is not None, "writes": len(lat), "p50_ms": p(0.5) * 1000, "p99_ms": p(0.99) * 1000,
            "diffs": loop.diffs if loop else 0, "rows_compared": loop.rows if loop else 0}


def measure(url: str, store_url: str, spec: MigrationSpec, args: argparse.Namespace,
            cpus: set[int] | None) -> list[dict[str, Any]]:
    """The rounds: a window without a diff and one with, in alternating order."""
    rounds = []
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        found = {with_diff: window(url, args, DiffLoop(url, spec.name, store_url, args.sample, args.diff_rate, cpus)
                                   if with_diff else None) for with_diff in order}
        rounds.append({"without": found[False], "with": found[True],
                       "p99_ratio": found[True]["p99_ms"] / found[False]["p99_ms"],
                       "p50_ratio": found[True]["p50_ms"] / found[False]["p50_ms"]})
    return rounds


def run(args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    database = f"bench_difload_{tag}"
    store_url = f"{args.store_server}/bench_difload_{tag}"
    rounds: list[dict[str, Any]] = []
    url = source_table(args.source, database, args.rows)
    try:
        spec = spec_for(url, f"bench-{tag}")
        with logstore.open(store_url, shards=args.shards) as store:
            source = open_source(spec)
            try:
                Mover(spec, source, store, chunk_rows=1000).run(follow=False)
            finally:
                source.stop_changes()
                source.close()
            everywhere = os.sched_getaffinity(0)
            pinned: tuple[int, int] | None = None
            if args.pin:
                pinned = server_pids(url, args.store_server)
                pin(pinned[0], {0})
                pin(pinned[1], {1})
                os.sched_setaffinity(0, {0})
            try:
                rounds += measure(url, store_url, spec, args, {1} if args.pin else None)
            finally:
                if pinned is not None:
                    pin(pinned[0], everywhere)
                    pin(pinned[1], everywhere)
                    os.sched_setaffinity(0, everywhere)
    finally:
        drop_database(store_url)
        drop_source(args.source, database)
    return {"shards": args.shards, "rows": args.rows, "writes_per_s": args.writes, "sample": args.sample,
            "diff_rate": args.diff_rate, "pinned": args.pin,
            "rounds": rounds, "p99_ratio_median": statistics.median(r["p99_ratio"] for r in rounds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="postgresql://cellstream:cellstream@127.0.0.1:5433/postgres")
    parser.add_argument("--store-server", default="mysql://cellstream:cellstream@127.0.0.1:3306")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--writes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample", type=float, default=0.01)
    parser.add_argument("--diff-rate", type=float, default=None, help="the diff's --rate: rows compared a second")
    parser.add_argument("--pin", action="store_true", help="the source on CPU 0, the store and the diff on CPU 1")
    args = parser.parse_args()
    r = run(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(r, indent=2) + "\n")
    for i, x in enumerate(r["rounds"], 1):
        w, wo = x["with"], x["without"]
        print(f"round {i}: without a diff p50 {wo['p50_ms']:.2f} ms p99 {wo['p99_ms']:.2f} ms; with "
              f"{w['diffs']} sampled diffs ({w['rows_compared']:,} rows compared) p50 {w['p50_ms']:.2f} ms p99 "
              f"{w['p99_ms']:.2f} ms; p99 ratio {x['p99_ratio']:.3f}")
    ratio = r["p99_ratio_median"]
    limit = (f" at {r['diff_rate']:g} rows/s" if r["diff_rate"] else "") + (", the source on a CPU of its own"
                                                                             if r["pinned"] else "")
    print(f"a {r['sample']:.0%} sampled diff{limit}, back to back, at {r['writes_per_s']} writes/s on "
          f"{r['rows']:,} rows: "
          f"the workload's p99 x{ratio:.3f} (median of {len(r['rounds'])} rounds; target <= 1.05: "
          f"{'met' if ratio <= 1.05 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
