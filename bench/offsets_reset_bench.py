"""What ``cellstream offsets reset`` of a consumer of every shard costs (issue 54: < 1 s at 4096 shards).

    python bench/offsets_reset_bench.py [--server URL] [--shards 4096] [--cells 20000] [--rounds 5]

A store of ``--shards`` shards in a fresh database of the MariaDB at ``--server`` (and an embedded SQLite one),
``--cells`` cells spread over them, and a consumer whose offsets cover every shard, committed at the heads (as an
app leaves them). Each round times, through the command's own code (plan, execute, record): a reset to the
beginning, to the end, to a time (a read per shard of the first cell at or after it), and one shard to a
location; and, as the yardstick, the raw ``Store.commit_offsets`` of the same positions by their holder (what one
commit of the consumer costs). Printed: the median seconds of each, and each reset's ratio to the raw commit.
Written to ``bench/results/offsets_reset.json``. Everything made is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logstore
from bench.scratch import scratch_database
from logstore.positions import parse_position
from tailer.offsets import ResetHistory
from tailer.offsets.store import StoreOffsets

CONSUMER = "app.bench"


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(url: str, shards: int, cells: int, rounds: int) -> dict[str, Any]:
    with logstore.open(url, shards=shards) as store:
        for start in range(0, cells, 5000):
            store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(start, min(cells, start + 5000))])
        middle = dt.datetime.now(dt.UTC)
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"late": True}) for _ in range(1000)])
        owner = "bench-holder"
        store.claim_offsets(CONSUMER, owner)
        heads = store.heads()
        place, history = StoreOffsets(store), ResetHistory(store)

        def raw_commit() -> None:
            store.claim_offsets(CONSUMER, owner)
            store.commit_offsets(CONSUMER, owner, {s: (h, {"deadlettered": 0, "last_error": None})
                                                   for s, h in heads.items()})

        def reset(text: str, chosen: list[int] | None = None) -> Callable[[], None]:
            def run() -> None:
                plan = place.execute(place.plan_reset(CONSUMER, parse_position(text), chosen))
                history.record_plan(plan, "bench")
            return run

        cases: dict[str, Callable[[], None]] = {
            "raw commit": raw_commit, "to beginning": reset("beginning"), "to end": reset("end"),
            "to a time": reset(middle.isoformat()), "one shard": reset("0:0", [0])}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, fn in cases.items():
                raw_commit()  # every reset starts from the consumer at its heads
                times[name].append(timed(fn))
        medians = {name: statistics.median(values) for name, values in times.items()}
        return {"shards": shards, "cells": cells + 1000, "median_seconds": medians,
                "ratio_to_raw_commit": {name: medians[name] / medians["raw commit"] for name in medians}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="mysql://cellstream:cellstream@127.0.0.1:3306")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--cells", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with scratch_database(args.server, f"bench_offsets_{uuid.uuid4().hex[:8]}") as url:
        results["mariadb"] = measure(url, args.shards, args.cells, args.rounds)
    with tempfile.TemporaryDirectory() as root:
        results["sqlite"] = measure(f"sqlite:///{root}/store", args.shards, args.cells, args.rounds)
    for backend, found in results.items():
        print(f"{backend}: {found['shards']} shards, {found['cells']} cells")
        for name, seconds in found["median_seconds"].items():
            verdict = "" if name == "raw commit" else (" (target < 1 s: met)" if seconds < 1 else
                                                        " (target < 1 s: MISSED)")
            print(f"  {name:<14} {seconds * 1000:8.1f} ms  x{found['ratio_to_raw_commit'][name]:.2f} of a raw "
                  f"commit{verdict}")
    out = Path(__file__).parent / "results" / "offsets_reset.json"
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
