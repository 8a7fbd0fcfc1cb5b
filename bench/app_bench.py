"""Stream-processing runtime benchmark, direct mode (python bench/app_bench.py [--store URL] [--shards N]).

1. Latency: writer threads put BASE cells at 1,000 cells/s for ``--seconds``; the app
   runs in its own process, where a no-op async handler records now - the write time
   carried in the body. Prints p50/p99 against the target (direct mode p99 <= 50 ms).
2. Throughput: ``--cells`` cells written first; ``app.drain`` with a no-op handler
   against the raw paged read of the same cells (Store.get_cells_for_shards, no
   handler) in the same run; prints cells/s and the ratio (target >= 0.5). The app is
   timed from its first handler call to its last (start-up excluded: claiming the
   shards and loading their offsets); the drain from its call to its return is printed too.
3. Shard count: the no-op drain of the same ``--scaling-cells`` cells from a store of
   ``--shards`` shards and from one of ``--base-shards`` (64), each drain a new app
   from the beginning, ``--rounds`` times alternating which goes first, on every store
   of ``--backends`` (SQLite, and MariaDB at ``--mysql``), with an async handler and,
   on SQLite, with a synchronous one too (run in the thread pool). Prints the ratio of
   the best rounds against the target (>= 0.7).

The process is tuned as ``cellstream run`` tunes an app's (``tune_for_streaming``: the collector's
thresholds, start-up frozen, the switch interval). Parts 1 and 2 use ``--shards`` shards (default 4096,
the store's default). Results go to bench/results/app.json. Default store: a fresh SQLite directory (the
embedded default); pass a mysql:// URL of an empty database for MariaDB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.scaling import compare_shard_counts
from bench.scratch import scratch_database
from cellstream.cli.common import tune_for_streaming
from indexer import App
from logstore import Cell
from tests.harness.shared_servers import MYSQL_SERVER as SERVER


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def serve_latency(url: str, out: str, expected: int) -> None:
    """(the app process) Run the app until ``expected`` cells were handled; write the latencies to ``out``."""
    samples: list[float] = []
    with logstore.open(url) as store:
        app = App("bench-latency", store=store, start_from="now")

        @app.trigger("BASE")
        async def noop(cell: Cell) -> None:
            samples.append(time.time() - cell.body["t"])

        async def scenario() -> None:
            stop = asyncio.Event()
            running = asyncio.create_task(app.run_async(stop))
            Path(out + ".ready").touch()
            deadline = time.monotonic() + 120
            while len(samples) < expected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stop.set()
            await running

        asyncio.run(scenario())
        app.close()
    Path(out).write_text(json.dumps(samples))


def latency(store: logstore.Store, url: str, rate: int, seconds: float, tmp: str) -> dict[str, Any]:
    """Writers in this process, the app in its own (as in production: they share no GIL)."""
    threads = 8
    total = int(rate * seconds) // threads * threads
    out = f"{tmp}/latency.json"
    child = subprocess.Popen([sys.executable, __file__, "--serve-latency", out, "--store", url,
                              "--expected", str(total)])
    while not Path(out + ".ready").exists():
        assert child.poll() is None, "the app process died"
        time.sleep(0.05)
    time.sleep(1.0)  # claimed and polling

    def writer(index: int) -> None:
        interval = threads / rate
        start = time.monotonic()
        for n in range(total // threads):
            pause = start + n * interval - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            store.put_cell(uuid.uuid4(), "BASE", 1, {"t": time.time(), "w": index})

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    child.wait(180)
    ms = [s * 1000 for s in json.loads(Path(out).read_text())]
    return {"cells": len(ms), "rate": rate, "p50_ms": round(percentile(ms, 0.5), 2),
            "p99_ms": round(percentile(ms, 0.99), 2), "max_ms": round(max(ms), 2),
            "mean_ms": round(statistics.fmean(ms), 2)}


def write(store: logstore.Store, cells: int) -> None:
    for start in range(0, cells, 1000):
        store.put_cells([(uuid.uuid4(), "TPUT", 1, {"n": n, "city": "Aarhus", "fare": 12.5})
                         for n in range(start, min(cells, start + 1000))])


def throughput(store: logstore.Store, cells: int) -> dict[str, Any]:
    write(store, cells)
    started = time.perf_counter()
    positions = dict.fromkeys(range(store.shard_count), 0)
    read = 0
    while positions:
        pages = store.get_cells_for_shards(positions, 500, columns=["TPUT"])
        for shard, page in pages.items():
            assert isinstance(page, list)
            read += len(page)
            if len(page) < 500:
                del positions[shard]
            else:
                positions[shard] = page[-1].added_id
    raw_seconds = time.perf_counter() - started
    app = App("bench-throughput", store=store)
    calls: list[float] = []  # when each handler call came

    @app.trigger("TPUT")
    async def noop(cell: Cell) -> None:
        calls.append(time.perf_counter())

    started = time.perf_counter()
    counts = app.drain(timeout=600)
    drain_seconds = time.perf_counter() - started
    app.close()
    assert counts.processed == cells == read, (counts, cells, read)
    raw, handled = cells / raw_seconds, cells / (calls[-1] - calls[0])
    return {"cells": cells, "raw_read_cells_per_s": round(raw), "app_cells_per_s": round(handled),
            "ratio": round(handled / raw, 3), "drain_cells_per_s": round(cells / drain_seconds),
            "drain_ratio": round(cells / drain_seconds / raw, 3)}


async def _noop(cell: Cell) -> None:
    return None


def _noop_sync(cell: Cell) -> None:
    return None


def drain_seconds(store: logstore.Store, name: str, cells: int, sync: bool = False) -> float:
    app = App(name, store=store)
    app.trigger("TPUT")(_noop_sync if sync else _noop)
    started = time.perf_counter()
    counts = app.drain(timeout=600)
    seconds = time.perf_counter() - started
    app.close()
    assert counts.processed == cells, (counts, cells)
    return seconds


def shard_scaling(backends: list[str], server: str, cells: int, base: int, shards: int,
                  rounds: int) -> dict[str, Any]:
    """The no-op drain rate with ``shards`` shards against ``base`` shards, on each backend."""
    out: dict[str, Any] = {}
    for backend in backends:
        with contextlib.ExitStack() as stack:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="cellstream-bench-"))
            stores: dict[int, logstore.Store] = {}
            for n in (base, shards):
                url = (f"sqlite:///{folder}/store{n}" if backend == "sqlite"
                       else stack.enter_context(scratch_database(server, f"app{n}")))
                stores[n] = stack.enter_context(logstore.open(url, shards=n))
                write(stores[n], cells)
            out[backend] = compare_shard_counts(
                f"{backend}: no-op drain", cells, base, shards, rounds, 0.7,
                lambda n, r: drain_seconds(stores[n], f"bench-scaling-{r}", cells))  # noqa: B023 (run at once)
            if backend == "sqlite":
                out["sqlite_sync"] = compare_shard_counts(
                    f"{backend}: no-op drain, synchronous handler", cells, base, shards, rounds, 0.7,
                    lambda n, r: drain_seconds(stores[n], f"bench-scaling-sync-{r}", cells, sync=True))  # noqa: B023
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="a mysql:// URL of an empty database (default: a fresh SQLite directory)")
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cells", type=int, default=50_000)
    parser.add_argument("--shards", type=int, default=4096, help="shards of the store (parts 1 and 2, and part 3's)")
    parser.add_argument("--base-shards", type=int, default=64, help="part 3 compares --shards with this")
    parser.add_argument("--scaling-cells", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3, help="part 3: drains per shard count")
    parser.add_argument("--backends", default="sqlite,mysql", help="part 3: stores to compare on")
    parser.add_argument("--mysql", default=SERVER, help="part 3: a mysql:// URL of the server (no database)")
    parser.add_argument("--only", choices=("latency", "throughput", "shards"), help="run one part (not saved)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "app.json"))
    parser.add_argument("--serve-latency", help=argparse.SUPPRESS)
    parser.add_argument("--expected", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tune_for_streaming()  # the app runs in this process (or, for latency, its child): as in a `cellstream run` one
    if args.serve_latency:
        serve_latency(args.store, args.serve_latency, args.expected)
        return 0
    result: dict[str, Any] = {"store": "sqlite" if not args.store else "mysql", "shards": args.shards}
    if args.only in (None, "latency", "throughput"):
        with tempfile.TemporaryDirectory(prefix="cellstream-bench-") as tmp:
            url = args.store or f"sqlite:///{tmp}/store"
            with logstore.open(url, shards=args.shards) as store:
                if args.only in (None, "latency"):
                    lat = result["latency"] = latency(store, url, args.rate, args.seconds, tmp)
                    print(f"latency put_cell -> handler at {args.rate}/s, {args.shards} shards: p50 {lat['p50_ms']} "
                          f"ms, p99 {lat['p99_ms']} ms (target p99 <= 50 ms: "
                          f"{'met' if lat['p99_ms'] <= 50 else 'MISSED'})", flush=True)
                if args.only in (None, "throughput"):
                    tput = result["throughput"] = throughput(store, args.cells)
                    print(f"throughput, no-op handler, {args.shards} shards: {tput['app_cells_per_s']} cells/s; raw "
                          f"paged read {tput['raw_read_cells_per_s']} cells/s; ratio {tput['ratio']} (target >= 0.5: "
                          f"{'met' if tput['ratio'] >= 0.5 else 'MISSED'}); the whole drain, start-up included: "
                          f"{tput['drain_cells_per_s']} cells/s, ratio {tput['drain_ratio']}", flush=True)
    if args.only in (None, "shards"):
        result["shard_scaling"] = shard_scaling(args.backends.split(","), args.mysql, args.scaling_cells,
                                                args.base_shards, args.shards, args.rounds)
    if args.only is None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
