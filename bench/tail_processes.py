"""Tailer processes sharing the shards: python bench/tail_processes.py [--cells N] [--processes 1,2,4].

``--cells`` cells (default 100,000) are written into a fresh MariaDB store of ``--shards`` shards
(default 4096). Then, for each count in ``--processes``, that many ``cellstream tail`` processes
start at once under one tailer name (ZooKeeper shares the shards among them) and publish the
cells to a topic of their own (16 partitions); the run ends when the topic's end offsets add up
to the cells. Printed per count: seconds from the processes' start (start-up included: process
start, ZooKeeper membership, the leader's assignment, the claims) and from the first message on
the topic, cells/s both ways, the speed-up over one process and the tail processes' CPU seconds.
Needs the shared test servers (make services-up). Results go to bench/results/tail_processes.json.

The machine's cores bound what this can show: MariaDB, Kafka and ZooKeeper run on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
from aiokafka import AIOKafkaConsumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.scratch import scratch
from bench.tailer_bench import KAFKA, SERVER, ZOOKEEPER, P, body, create_topic


async def end_offsets_total(consumer: AIOKafkaConsumer, parts: list[TopicPartition]) -> int:
    return sum((await consumer.end_offsets(parts)).values())


async def measure(url: str, zk: str, prefix: str, processes: int, cells: int) -> dict[str, Any]:
    name = f"scale{processes}"
    topic = f"{prefix}-{processes}.BASE"
    await create_topic(topic)
    consumer = AIOKafkaConsumer(bootstrap_servers=KAFKA)
    await consumer.start()
    parts = [TopicPartition(topic, p) for p in range(P)]
    command = [sys.executable, "-m", "cellstream", "tail", "--store", url, "--brokers", KAFKA, "--zookeeper", zk,
               "--name", name, "--prefix", f"{prefix}-{processes}", "--partitions", str(P), "--columns", "BASE"]
    started = time.perf_counter()
    workers = [subprocess.Popen(command, stderr=subprocess.DEVNULL) for _ in range(processes)]
    first = None
    try:
        while True:
            total = await end_offsets_total(consumer, parts)
            now = time.perf_counter()
            if first is None and total:
                first = now
            if total >= cells:
                break
            assert all(w.poll() is None for w in workers), "a tail process died"
            assert now - started < 600, f"only {total} of {cells} cells after 600 s"
            await asyncio.sleep(0.05)
        done = time.perf_counter()
        cpu = sum(sum(psutil.Process(w.pid).cpu_times()[:2]) for w in workers)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(60)
        await consumer.stop()
    assert first is not None
    whole, steady = done - started, done - first
    print(f"{processes} process(es): {whole:.2f} s from start ({cells / whole:.0f} cells/s), {steady:.2f} s from the "
          f"first message ({cells / steady:.0f} cells/s); {cpu:.1f} CPU s in the tail processes", flush=True)
    return {"processes": processes, "seconds_from_start": whole, "seconds_from_first_message": steady,
            "cells_per_s_from_start": cells / whole, "cells_per_s_from_first_message": cells / steady,
            "tail_cpu_seconds": cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "tail_processes.json"))
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.processes.split(",")]
    results: dict[str, Any] = {"cells": args.cells, "shards": args.shards, "cpus": os.cpu_count(), "runs": []}
    with scratch(SERVER, ZOOKEEPER, KAFKA, "procs") as (url, zk, prefix), \
            logstore.open(url, shards=args.shards) as store:
        for start in range(0, args.cells, 1000):
            store.put_cells([(uuid.uuid4(), "BASE", 1, body(i)) for i in range(start, min(args.cells, start + 1000))])
        for processes in counts:
            results["runs"].append(asyncio.run(measure(url, zk, prefix, processes, args.cells)))
    base = results["runs"][0]["cells_per_s_from_start"]
    for run in results["runs"]:
        run["speed_up_from_start"] = run["cells_per_s_from_start"] / base
        print(f"{run['processes']} process(es): speed-up over {counts[0]} (from start) "
              f"{run['speed_up_from_start']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
