"""Replay benchmark (python bench/replay_bench.py [--backends sqlite,mysql] [--shards N] [--cells N]).

``--cells`` cells are written over a store of ``--shards`` shards (default 4096); then, ``--rounds`` times,
alternating which goes first, the same app (a no-op handler, async and then synchronous, run in the thread
pool) drains them from scratch (``app.drain``, a new consumer each round: the tailer's worker, offsets in the
store) and a replay job (:mod:`indexer.runtime.replay`, ``--from beginning``) runs it over the same cells
(``JobRunner.run``, planned beforehand). Each is timed whole, from its call to its return (start-up included:
claiming the shards, counting the range). Prints each one's best rate and the ratio replay/drain against the
target (>= 0.8). Results go to bench/results/replay.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.scratch import scratch_database
from cellstream.cli.common import tune_for_streaming
from indexer import App
from indexer.runtime.replay import Replay, replay_params
from logstore import Cell
from logstore.jobs import JobRunner, KindRegistry
from tests.harness.shared_servers import MYSQL_SERVER as SERVER

TARGET = 0.8


def write(store: logstore.Store, cells: int) -> None:
    for start in range(0, cells, 1000):
        store.put_cells([(uuid.uuid4(), "TPUT", 1, {"n": n, "city": "Aarhus", "fare": 12.5})
                         for n in range(start, min(cells, start + 1000))])


async def _noop(cell: Cell) -> None:
    return None


def _noop_sync(cell: Cell) -> None:
    return None


def _app(store: logstore.Store, name: str, sync: bool) -> App:
    app = App(name, store=store)
    app.trigger("TPUT")(_noop_sync if sync else _noop)
    return app


def drain_seconds(store: logstore.Store, name: str, cells: int, sync: bool) -> float:
    app = _app(store, name, sync)
    started = time.perf_counter()
    counts = app.drain(timeout=900)
    seconds = time.perf_counter() - started
    app.close()
    assert counts.processed == cells, (counts, cells)
    return seconds


def replay_seconds(store: logstore.Store, name: str, cells: int, sync: bool) -> float:
    app = _app(store, name, sync)
    handled: list[int] = []

    def close() -> None:  # after the step: what its processor handled
        handled.append(app.processor.counts.processed)
        app.close()
    runner = JobRunner(store, KindRegistry([Replay(store, lambda _params: (app, close))]))
    job = runner.submit("replay", replay_params(app, {"app": "bench"}, start="beginning"))
    assert job.total == cells, (job.total, cells)
    started = time.perf_counter()
    record = runner.run(job.id)
    seconds = time.perf_counter() - started
    assert record.state == "done" and sum(handled) == cells, (record.state, record.error, handled)
    return seconds


def compare(label: str, cells: int, rounds: int, drain: Callable[[int], float],
            replay: Callable[[int], float]) -> dict[str, Any]:
    drains: list[float] = []
    replays: list[float] = []
    for r in range(rounds):
        if r % 2:
            replays.append(replay(r))
            drains.append(drain(r))
        else:
            drains.append(drain(r))
            replays.append(replay(r))
    drain_rate, replay_rate = cells / min(drains), cells / min(replays)
    ratio = replay_rate / drain_rate
    print(f"{label}: drain from scratch {drain_rate:,.0f} cells/s, replay {replay_rate:,.0f} cells/s, "
          f"ratio {ratio:.2f} (target >= {TARGET}) {'OK' if ratio >= TARGET else 'BELOW TARGET'}")
    return {"drain_cells_per_s": round(drain_rate), "replay_cells_per_s": round(replay_rate),
            "ratio": round(ratio, 3), "drain_seconds": [round(s, 3) for s in drains],
            "replay_seconds": [round(s, 3) for s in replays]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,mysql", help="stores to compare on")
    parser.add_argument("--mysql", default=SERVER, help="a mysql:// URL of the server (no database)")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "replay.json"))
    args = parser.parse_args(argv)
    tune_for_streaming()  # as `cellstream run` and `cellstream replay` processes are
    results: dict[str, Any] = {"shards": args.shards, "cells": args.cells}
    for backend in args.backends.split(","):
        with contextlib.ExitStack() as stack:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="cellstream-bench-"))
            url = (f"sqlite:///{folder}/store" if backend == "sqlite"
                   else stack.enter_context(scratch_database(args.mysql, "replay")))
            store = stack.enter_context(logstore.open(url, shards=args.shards))
            write(store, args.cells)
            for sync in (False, True):
                label = f"{backend}, {'synchronous' if sync else 'async'} no-op handler, {args.shards} shards"
                kind = "sync" if sync else "async"
                results[f"{backend}_{kind}"] = compare(
                    label, args.cells, args.rounds,
                    lambda r: drain_seconds(store, f"bench-drain-{kind}-{r}", args.cells, sync),  # noqa: B023
                    lambda r: replay_seconds(store, f"bench-replay-{kind}-{r}", args.cells, sync))  # noqa: B023
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    worst = min(v["ratio"] for k, v in results.items() if isinstance(v, dict))
    return 0 if worst >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
