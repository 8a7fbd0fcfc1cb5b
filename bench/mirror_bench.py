"""A standby mirror's lag (issue 52, "Benchmarks": mirror lag p99 at 1,000 cells/s <= 1 s).

    python bench/mirror_bench.py [--server URL] [--shards 4096] [--rate 1000] [--seconds 60] [--batch 10]

Two fresh databases of the MariaDB at ``--server``, each an instance of ``--shards`` shards: a writer puts
``--rate`` cells a second into A (``--batch`` cells a put, each to a random shard), while a :class:`Mirror`
copies A into B in a thread of this process, as ``cellstream mirror run`` does. A cell's lag is the time from
its ``created_at`` on A (its transaction's time) to the end of the write that put it on B (measured around
B's ``restore_cells``). Printed: the lag's p50, p99 and max, the cells copied a second, and the writer's
achieved rate; written to ``bench/results/mirror.json``. Both instances and the mirror share the machine's
cores and one server: the figure is an upper bound of a mirror between two sites' own servers, less the link.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logstore
from bench.scratch import scratch_database
from logstore.mirror import Mirror
from logstore.persistence import RestoredCell

RESULTS = Path(__file__).resolve().parent / "results" / "mirror.json"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    with scratch_database(args.server, "mirror_a") as a_url, scratch_database(args.server, "mirror_b") as b_url, \
            logstore.open(a_url, shards=args.shards) as a, logstore.open(b_url, shards=args.shards) as b:
        lags: list[float] = []
        for node in b.nodes:
            recorder = b.node_recorder(node)
            assert recorder is not None
            restore = recorder.restore_cells

            def timed(cells: Any, restore: Any = restore) -> None:
                restore(cells)
                now = dt.datetime.now(dt.UTC)
                lags.extend((now - c.created_at).total_seconds() for c in cells if isinstance(c, RestoredCell))
            recorder.restore_cells = timed  # type: ignore[method-assign]
        mirror = Mirror(a, b)
        stop = threading.Event()
        copier = threading.Thread(target=mirror.run, args=(stop,), kwargs={"interval": 0.01}, daemon=True)
        copier.start()
        written = 0
        started = time.monotonic()
        interval = args.batch / args.rate
        next_at = started
        while time.monotonic() - started < args.seconds:
            a.put_cells([(uuid.uuid4(), "bench", 1, {"n": written + i, "pad": "x" * 100}) for i in range(args.batch)])
            written += args.batch
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 30
        while len(lags) < written and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        copier.join(30)
        warm = lags[len(lags) // 20:]  # the first 5%: the mirror's first complete count of every shard
        return {"shards": args.shards, "rate": args.rate, "seconds": args.seconds, "written": written,
                "achieved_rate": written / elapsed, "copied": len(lags),
                "lag_p50_s": statistics.median(warm), "lag_p99_s": percentile(warm, 99), "lag_max_s": max(warm)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="mysql://cellstream:cellstream@127.0.0.1:3306")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--rate", type=float, default=1000.0, help="cells a second written to the source")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--batch", type=int, default=10, help="cells a put")
    args = parser.parse_args()
    result = run(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['shards']} shards, {result['achieved_rate']:.0f} cells/s written for {result['seconds']:g} s, "
          f"{result['copied']} of {result['written']} copied: mirror lag p50 {result['lag_p50_s'] * 1000:.0f} ms, "
          f"p99 {result['lag_p99_s'] * 1000:.0f} ms, max {result['lag_max_s'] * 1000:.0f} ms "
          f"(target p99 <= 1 s: {'met' if result['lag_p99_s'] <= 1.0 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
