"""A tailer's start at 64 and 4096 shards: python bench/tail_start.py [--rounds 2].

A `cellstream tail` process (``--from now``, MariaDB store of the test servers, empty, ZooKeeper and
Kafka) starts, and the run times it until it holds every shard's claim (its ``claims/<shard>`` nodes
in ZooKeeper, polled every 0.2 s): wall time from the process's start and the process's CPU seconds
then, and its CPU a second over the 2 s after. --rounds starts at each count, alternating which goes
first; the best of each is compared (ratio of 64 shards' time to 4096's, target >= 0.9: the shard
count costs nothing). Needs the shared test servers (make services-up).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.scratch import scratch, wait_claimed
from tests.harness.shared_servers import KAFKA, MYSQL_SERVER, ZOOKEEPER


def start(shards: int) -> tuple[float, float, float]:
    """Seconds until every shard is claimed, the process's CPU seconds until then, its CPU/s after."""
    with scratch(MYSQL_SERVER, ZOOKEEPER, KAFKA, "start") as (url, zk, prefix):
        logstore.open(url, shards=shards).close()
        started = time.perf_counter()
        worker = subprocess.Popen([sys.executable, "-m", "cellstream", "tail", "--store", url, "--brokers", KAFKA,
                                   "--zookeeper", zk, "--name", "start", "--prefix", prefix, "--partitions", "16",
                                   "--from", "now"], stderr=subprocess.DEVNULL)
        try:
            process = psutil.Process(worker.pid)
            wait_claimed(zk, "start", shards, worker, 180)
            wall = time.perf_counter() - started
            cpu = sum(process.cpu_times()[:2])
            time.sleep(2)
            after = (sum(process.cpu_times()[:2]) - cpu) / 2
        finally:
            worker.terminate()
            worker.wait(60)
    return wall, cpu, after


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--base-shards", type=int, default=64)
    parser.add_argument("--shards", type=int, default=4096)
    args = parser.parse_args()
    runs: dict[int, list[tuple[float, float, float]]] = {args.base_shards: [], args.shards: []}
    for r in range(args.rounds):
        for n in (args.base_shards, args.shards) if r % 2 == 0 else (args.shards, args.base_shards):
            runs[n].append(start(n))
            wall, cpu, after = runs[n][-1]
            print(f"{n} shards: every shard claimed {wall:.2f} s after the start, {cpu:.2f} s of CPU; "
                  f"then {after:.3f} s of CPU a second", flush=True)
    best = {n: min(r[0] for r in runs[n]) for n in runs}
    ratio = best[args.base_shards] / best[args.shards]
    print(f"start to every claim: {best[args.base_shards]:.2f} s at {args.base_shards} shards, "
          f"{best[args.shards]:.2f} s at {args.shards}: ratio {ratio:.2f} "
          f"(target >= 0.9: {'met' if ratio >= 0.9 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
