"""The write path's two targets (issue 51, point 5), repeated in one run: logstore's batched and single puts
against raw pymysql, on a fresh database of the same MariaDB.

    python bench/write_path_bench.py [--server URL] [--shards S] [--repeats N] [--cells N] [--puts N]

It reuses ``bench/logstore_bench.py``'s harness (its raw one-table schema, bodies and both measures):

- batched put: ``Store.put_cells`` of 1,000-cell batches spread over every shard against one multi-row
  INSERT of the same rows into a plain table of the cells schema (target: ratio of rates >= 0.8);
- durable single put: ``Store.put_cell`` (autocommit, one cell) against a raw autocommit single-row INSERT,
  ABBA-interleaved (target: p50 ratio <= 1.3).

Each repeat runs both measures, alternating which goes first; the medians and ranges of the ratios are
printed, and every repeat's figures are written to ``bench/results/write_path.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.logstore_bench import Bench
from bench.scratch import drop_database
from tests.harness.shared_servers import MYSQL_SERVER as SERVER

BATCH_TARGET = 0.8
SINGLE_TARGET = 1.3


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=SERVER, help="MariaDB server URL without database")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cells", type=int, default=10_000, help="cells per batched-put round (4 rounds a repeat)")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--puts", type=int, default=1000, help="single puts a side a repeat")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "write_path.json"))
    args = parser.parse_args()

    url = f"{args.server.rstrip('/')}/csbench_wp_{uuid.uuid4().hex[:8]}"
    bench = Bench(url, args.shards)
    runs: list[dict[str, Any]] = []
    try:
        bench.store.put_cells(bench.rows(args.batch, 10**8))  # warm the store's pool and plans: not measured
        bench.raw_put_one_table(bench.rows(args.batch, 2 * 10**8))
        for r in range(args.repeats):
            parts: list[tuple[str, Callable[[], None]]] = [
                ("batched_put", lambda: bench.batched_puts(args.cells, args.batch)),
                ("single_put", lambda: bench.single_puts(args.puts))]
            for name, part in parts if r % 2 == 0 else parts[::-1]:
                part()
                print(f"repeat {r + 1}: {name} {summary(name, bench.results[name])}", file=sys.stderr, flush=True)
            runs.append({"batched_put": dict(bench.results["batched_put"]),
                         "single_put": dict(bench.results["single_put"])})
    finally:
        bench.close()
        drop_database(url)

    batched = spread([run["batched_put"]["ratio"] for run in runs])
    single = spread([run["single_put"]["ratio_p50"] for run in runs])
    results = {"shards": args.shards, "batch": args.batch, "repeats": runs, "batched_put_ratio": batched,
               "single_put_ratio_p50": single,
               "batched_put_cells_per_s": {side: spread([run["batched_put"][f"{side}_cells_per_s"] for run in runs])
                                           for side in ("project", "raw")},
               "single_put_p50_ms": {side: spread([run["single_put"][f"{side}_p50_ms"] for run in runs])
                                     for side in ("project", "raw")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    bp, sp = results["batched_put_cells_per_s"], results["single_put_p50_ms"]
    print(f"\n{args.shards} shards, {len(runs)} repeats (medians, ranges in brackets)")
    print(f"batched put, cells/s: logstore {bp['project']['median']:.0f}, raw {bp['raw']['median']:.0f};"
          f" ratio {batched['median']:.2f} [{batched['min']:.2f}-{batched['max']:.2f}]"
          f" target >= {BATCH_TARGET}: {'met' if batched['median'] >= BATCH_TARGET else 'MISSED'}")
    print(f"durable single put p50, ms: logstore {sp['project']['median']:.3f}, raw {sp['raw']['median']:.3f};"
          f" ratio {single['median']:.2f} [{single['min']:.2f}-{single['max']:.2f}]"
          f" target <= {SINGLE_TARGET}: {'met' if single['median'] <= SINGLE_TARGET else 'MISSED'}")
    return 0


def summary(name: str, r: dict[str, Any]) -> str:
    if name == "batched_put":
        return f"{r['project_cells_per_s']:.0f} / {r['raw_cells_per_s']:.0f} cells/s = {r['ratio']:.2f}"
    return f"p50 {r['project_p50_ms']:.3f} / {r['raw_p50_ms']:.3f} ms = {r['ratio_p50']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
