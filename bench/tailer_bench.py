"""The tailer end to end against the raw libraries doing its two halves, in one run.

    python bench/tailer_bench.py [--cells N] [--shards S] [--rate R] [--seconds T] [--formats json,msgpack]
                                 [--only throughput|latency|shards] [--backends sqlite,mysql,http]

1. raw read: pymysql paging the same cells out of the node's `cells` table (500 a page, in
   primary key order: shard, added_id).
2. raw produce: aiokafka (idempotent, acks=all) producing the tailer's very messages
   (same keys, headers, values, partitions), pre-encoded, awaiting every ack: once with
   one send() per message, once with a record batch per shard page (send_batch, as the
   tailer does). The faster of the two is the raw produce figure.
3. tailer: a fresh tailer (ZooKeeper offsets, Kafka) from the beginning of the same
   store until every cell is acknowledged and committed.
Parts 2 and 3 run once per value format (--formats: JSON, MessagePack). The throughput
ratio is tailer / min(raw read, raw send_batch) in each format (target >= 0.6), the tailer
timed from its first acknowledged cell (start-up, claiming the shards, excluded; the rate
from its start is printed too). The whole run has the garbage collector's thresholds of a
`cellstream tail` process.

Latency: a `cellstream tail` process runs while this process puts cells at R cells/s
and an aiokafka consumer reads them; latency is from put_cell returning to the
consumer holding the message (targets p50 <= 20 ms, p99 <= 100 ms). The tailer's process
is measured meanwhile: CPU and context switches a second.

Shard count: the standalone tailer (offsets in a file, topics as files, so only the
store and the worker are measured) drains the same --scaling-cells cells from a store
of --base-shards (64) and one of --scaling-shards (4096), fresh from the beginning,
--rounds times alternating which goes first; on SQLite (embedded), on MariaDB and through a
worker node (`cellstream serve` in front of SQLite). The ratio of the best rounds is the target
(>= 0.9): the shard count must cost nothing. So too for the cost of a look, what a tailer pays
100-200 times a second while cells trickle in: the counts since its previous look, one cell
written between (the median of 1,000, the best of --rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import psutil
import pymysql
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.pacing import latencies, paced_puts
from bench.scaling import compare_shard_counts
from bench.scratch import scratch, scratch_database, served, wait_claimed
from cellstream.cli.common import tune_for_streaming
from logstore.backends.mysql.target import MySQLTarget
from logstore.config import parse_node_url
from tailer.config import KafkaOptions, TailerConfig
from tailer.coordinators.local import LocalCoordinator
from tailer.coordinators.zookeeper import ZooKeeperCoordinator
from tailer.messages import encode_cell
from tailer.publishers.directory import DirectoryPublisher
from tailer.publishers.kafka import KafkaPublisher
from tailer.worker import Tailer
from tests.harness.shared_servers import KAFKA, ZOOKEEPER
from tests.harness.shared_servers import MYSQL_SERVER as SERVER

P = 16
ValueFormat = Literal["json", "msgpack"]
POLL = float(os.environ.get("BENCH_POLL", "0.005"))


def body(i: int) -> dict[str, Any]:
    return {"rider_uuid": str(uuid.UUID(int=i)), "city": "Aarhus", "fare": round(5 + i % 50 * 0.75, 2),
            "distance_km": (i % 300) / 10, "product": "uberX", "route": [[55.67, 12.56], [55.68, 12.57]]}


def raw_read(url: str) -> tuple[float, int]:
    """Every cell of the node's one `cells` table, 500 a page in primary key order (shard, added_id).
    The condition is spelled as two ranges rather than a row comparison, which MariaDB may not use
    the primary key for."""
    t = parse_node_url(url)
    assert isinstance(t, MySQLTarget)
    conn = pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password, database=t.database)
    rows = 0
    start = time.perf_counter()
    shard, location = -1, 0
    with conn.cursor() as cur:
        while True:
            cur.execute("SELECT shard, added_id, row_key, column_name, ref_key, body, created_at FROM cells "
                        "WHERE shard > %s OR (shard = %s AND added_id > %s) ORDER BY shard, added_id LIMIT 500",
                        (shard, shard, location))
            page = cur.fetchall()
            if not page:
                break
            rows += len(page)
            shard, location = page[-1][0], page[-1][1]
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed, rows


async def raw_produce(store: logstore.Store, topic: str, value_format: ValueFormat) -> dict[str, float]:
    """cells/s of aiokafka producing the tailer's messages, pre-encoded: one send() per message,
    and record batches of a shard page each (send_batch, what the tailer uses). Warmed up first."""
    pages: list[tuple[int, list[Any]]] = []
    for shard in range(store.shard_count):
        location = 0
        while True:
            cells, location = store.get_cells_for_shard(shard, location, 500)
            if not cells:
                break
            pages.append((shard % P, [encode_cell(c, value_format) for c in cells]))
    total = sum(len(m) for _, m in pages)
    await create_topic(topic)
    producer = AIOKafkaProducer(bootstrap_servers=KAFKA, acks="all", enable_idempotence=True, linger_ms=2,
                                max_batch_size=256 * 1024)
    await producer.start()

    async def send_each(chunk: list[tuple[int, list[Any]]]) -> None:
        futures = [await producer.send(topic, m.value, key=m.key, partition=p, headers=m.headers)
                   for p, page in chunk for m in page]
        await asyncio.gather(*futures)

    async def send_batches(chunk: list[tuple[int, list[Any]]]) -> None:
        futures = []
        for p, page in chunk:
            batch = producer.create_batch()
            for m in page:
                if batch.append(key=m.key, value=m.value, timestamp=None, headers=m.headers) is None:
                    futures.append(await producer.send_batch(batch, topic, partition=p))
                    batch = producer.create_batch()
                    batch.append(key=m.key, value=m.value, timestamp=None, headers=m.headers)
            futures.append(await producer.send_batch(batch, topic, partition=p))
        await asyncio.gather(*futures)

    out = {}
    try:
        await send_each(pages[:10])  # warm-up: connections, metadata, the broker's JIT
        for name, run in (("produce_send", send_each), ("produce_batch", send_batches)):
            start = time.perf_counter()
            await run(pages)
            out[name] = total / (time.perf_counter() - start)
    finally:
        await producer.stop()
    return out


async def create_topic(topic: str) -> None:
    from aiokafka.admin import NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, P, 1)])
    finally:
        await admin.close()


async def tailer_run(store: logstore.Store, zk: str, prefix: str, value_format: ValueFormat,
                     cells: int) -> tuple[float, float]:
    """Seconds from the tailer's start, and from its first acknowledged cell, until every cell is acknowledged
    (the first excludes start-up: claiming 4096 shards through ZooKeeper took about 1.6 s here)."""
    config = TailerConfig(name=f"bench-{value_format}", topic_prefix=prefix, partitions=P, value_format=value_format)
    tailer = Tailer(store, config, ZooKeeperCoordinator(zk, config.name, store.shard_count),
                    KafkaPublisher(KafkaOptions(brokers=KAFKA)))
    heads = store.heads()
    await create_topic(f"{prefix}.BASE")
    await tailer.start()
    start = time.perf_counter()
    first = None
    while True:
        # The acknowledged count from the metrics until it is complete, then the positions: reading 4096 of
        # them every 20 ms took a twentieth of the loop the run measures.
        acked = tailer.metrics.registry.get_sample_value("cellstream_tailer_published_total",
                                                         {"tailer": config.name}) or 0
        if first is None and acked:
            first = time.perf_counter()
        if acked >= cells:
            positions = tailer.positions()
            if len(positions) == store.shard_count and all(positions[s][1] >= heads[s] for s in heads):
                break
        await asyncio.sleep(0.02)
    elapsed = time.perf_counter() - start
    await tailer.stop()
    return elapsed, elapsed - (first - start if first is not None else 0.0)


def process_load(process: psutil.Process) -> tuple[float, int, int]:
    """(CPU seconds, voluntary and involuntary context switches) of a process and all its threads so far.

    The switches are summed over /proc/PID/task (Linux): psutil's num_ctx_switches counts the main thread's."""
    cpu = process.cpu_times()
    switches = [0, 0]
    for status in Path(f"/proc/{process.pid}/task").glob("*/status"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            for line in status.read_text().splitlines():
                name, _, value = line.partition(":")
                if name in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                    switches[name == "nonvoluntary_ctxt_switches"] += int(value)
    return cpu.user + cpu.system, switches[0], switches[1]


async def latency(store_url: str, store: logstore.Store, zk: str, prefix: str, rate: float,
                  seconds: float) -> tuple[list[float], dict[str, float]]:
    """The latencies (ms), and the `cellstream tail` process's load a second while the writers ran: CPU
    seconds, and voluntary and involuntary context switches (each involuntary one a wait for a core, which
    is where the tail of the latency comes from on a machine whose cores are all busy)."""
    topic = f"{prefix}.LAT"
    await create_topic(topic)
    worker = subprocess.Popen(
        [sys.executable, "-m", "cellstream", "tail", "--store", store_url, "--brokers", KAFKA, "--zookeeper", zk,
         "--name", "latency", "--prefix", prefix, "--partitions", str(P), "--columns", "LAT", "--from", "now",
         "--poll", str(POLL)],
        stderr=subprocess.DEVNULL)
    # The consumer runs in its own process, so the writers' threads do not delay its clock readings.
    reader = subprocess.Popen([sys.executable, __file__, "--consume", topic, "--seconds", str(seconds + 5)],
                              stdout=subprocess.PIPE, text=True)
    assert reader.stdout is not None
    assert reader.stdout.readline().strip() == "ready"
    wait_claimed(zk, "latency", store.shard_count, worker, 180)  # thousands of shards take a while
    process = psutil.Process(worker.pid)
    before = process_load(process)
    started = time.perf_counter()
    put_at = paced_puts(store, "LAT", rate, seconds, body)
    elapsed = time.perf_counter() - started
    load = dict(zip(("cpu_s", "voluntary_switches", "involuntary_switches"),
                    ((after - was) / elapsed for after, was in zip(process_load(process), before, strict=True)),
                    strict=True))
    print(f"   wrote {len(put_at) / elapsed:.0f} cells/s; the tailer's process a second: {load['cpu_s']:.2f} s of"
          f" CPU, {load['voluntary_switches']:.0f} voluntary and {load['involuntary_switches']:.0f} involuntary"
          " context switches", flush=True)
    got: dict[str, float] = json.loads(reader.communicate()[0])
    worker.terminate()
    worker.wait(timeout=60)
    return latencies(put_at, got, "consumer"), load


async def consume(topic: str, seconds: float) -> None:
    """(the --consume process) Print "ready", then {key: time.time() on receipt} as JSON after ``seconds``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=KAFKA, enable_auto_commit=False, fetch_max_wait_ms=100)
    await consumer.start()
    parts = [TopicPartition(topic, p) for p in range(P)]
    consumer.assign(parts)
    await consumer.seek_to_end(*parts)
    for p in parts:
        await consumer.position(p)
    print("ready", flush=True)
    got: dict[str, float] = {}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for records in (await consumer.getmany(timeout_ms=50)).values():
            now = time.time()
            for r in records:
                got.setdefault(r.key.decode(), now)
    await consumer.stop()
    print(json.dumps(got), flush=True)


def throughput(store: logstore.Store, url: str, zk: str, prefix: str, cells: int, shards: int,
               formats: list[ValueFormat]) -> dict[str, Any]:
    print(f"writing {cells} cells into {shards} shards ...", flush=True)
    for start in range(0, cells, 1000):
        store.put_cells([(uuid.uuid4(), "BASE", 1, body(i)) for i in range(start, min(cells, start + 1000))])
    read_s, rows = raw_read(url)
    assert rows == cells, (rows, cells)
    print(f"raw paged SELECT               {cells / read_s:10.0f} cells/s")
    out: dict[str, Any] = {"raw_read_cells_per_s": cells / read_s}
    for value_format in formats:
        raw = {"read": cells / read_s,
               **asyncio.run(raw_produce(store, f"{prefix}.raw-{value_format}", value_format))}
        whole, steady = asyncio.run(tailer_run(store, zk, f"{prefix}-{value_format}", value_format, cells))
        tail = cells / steady
        slower = min(raw["read"], raw["produce_batch"])
        ratio = tail / slower
        print(f"{value_format:8} raw aiokafka send()        {raw['produce_send']:10.0f} cells/s")
        print(f"{value_format:8} raw aiokafka send_batch()  {raw['produce_batch']:10.0f} cells/s")
        print(f"{value_format:8} tailer, first cell to last {tail:10.0f} cells/s   ratio to the slower of read and "
              f"send_batch: {ratio:.2f} (>= 0.6: {'met' if ratio >= 0.6 else 'MISSED'}); from its start "
              f"{cells / whole:.0f} cells/s", flush=True)
        out[value_format] = {"raw_cells_per_s": raw, "tailer_cells_per_s": tail,
                             "tailer_from_start_cells_per_s": cells / whole, "ratio": ratio}
    return out


async def standalone_drain(store: logstore.Store, folder: Path, name: str) -> float:
    """Seconds a fresh standalone tailer takes from its start until every cell in the store is acknowledged."""
    config = TailerConfig(name=name, partitions=P)
    tailer = Tailer(store, config, LocalCoordinator(folder / f"{name}.offsets.json", store.shard_count),
                    DirectoryPublisher(folder / name))
    since = time.monotonic()
    start = time.perf_counter()
    await tailer.start()
    while not tailer.caught_up(since):
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - start
    await tailer.stop()
    return elapsed


def shard_scaling(backends: list[str], cells: int, base: int, shards: int, rounds: int) -> dict[str, Any]:
    """Per backend, at ``shards`` shards against ``base``: the standalone tailer's drain rate and the cost of a
    look (the counts a tailer reads, with one cell written since the previous look)."""
    out: dict[str, Any] = {}
    for backend in backends:
        with contextlib.ExitStack() as stack:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cellstream-bench-")))
            stores: dict[int, logstore.Store] = {}
            for n in (base, shards):
                url = (stack.enter_context(scratch_database(SERVER, f"tail{n}")) if backend == "mysql"
                       else f"sqlite:///{folder}/store{n}")
                with logstore.open(url, shards=n) as store:
                    for start in range(0, cells, 1000):
                        store.put_cells([(uuid.uuid4(), "BASE", 1, body(i))
                                         for i in range(start, min(cells, start + 1000))])
                if backend == "http":  # a worker node in front of SQLite, in a process of its own
                    url = stack.enter_context(served(url))[0]
                stores[n] = stack.enter_context(logstore.open(url, shards=n))
            out[backend] = compare_shard_counts(
                f"{backend}: standalone tailer", cells, base, shards, rounds, 0.9,
                lambda n, r: asyncio.run(standalone_drain(stores[n], folder, f"r{r}-{n}")))  # noqa: B023 (run at once)
            spent: dict[int, list[float]] = {base: [], shards: []}
            for r in range(rounds):  # the best round of each, alternating which goes first, as the drains
                for n in (base, shards) if r % 2 == 0 else (shards, base):
                    spent[n].append(look_cost(stores[n]))
            out[backend]["look_ms"] = looks = {str(n): min(s) for n, s in spent.items()}
            ratio = looks[str(base)] / looks[str(shards)]
            print(f"{backend}: a look (counts since the last, one cell written between) {looks[str(base)]:.3f} ms at "
                  f"{base} shards, {looks[str(shards)]:.3f} at {shards}: ratio {ratio:.2f} "
                  f"(target >= 0.9: {'met' if ratio >= 0.9 else 'MISSED'})", flush=True)
            out[backend]["look_ratio"] = round(ratio, 3)
    return out


def look_cost(store: logstore.Store, looks: int = 1000) -> float:
    """Milliseconds of a tailer's look at the counts (``changed_counts`` since the previous one's mark) with
    one cell written since, the median of ``looks``."""
    mark = store.changed_counts().mark
    spent: list[float] = []
    for i in range(looks):
        store.put_cell(uuid.uuid4(), "LOOK", 1, {"i": i})
        start = time.perf_counter()
        mark = store.changed_counts(mark).mark
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e3


def main() -> int:
    tune_for_streaming()  # the tailer runs in this process: as in a `cellstream tail` process
    if os.environ.get("BENCH_SWITCH"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH"]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=50_000)
    parser.add_argument("--formats", default="json,msgpack", help="value formats of the throughput runs")
    parser.add_argument("--shards", type=int, default=4096,
                        help="shards of the store of the throughput and latency parts (default 4096, the store's)")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--consume", help=argparse.SUPPRESS)  # the latency run's consumer process
    parser.add_argument("--only", choices=("throughput", "latency", "shards"), help="run one part (results not saved)")
    parser.add_argument("--backends", default="sqlite,mysql,http",
                        help="stores of the shard-count comparison (http: a worker node in front of SQLite)")
    parser.add_argument("--scaling-cells", type=int, default=20_000)
    parser.add_argument("--base-shards", type=int, default=64)
    parser.add_argument("--scaling-shards", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3, help="drains per shard count, alternating which goes first")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tailer.json"))
    args = parser.parse_args()
    if args.consume:
        asyncio.run(consume(args.consume, args.seconds))
        return 0
    scaling: dict[str, Any] = {}
    if args.only in (None, "shards"):
        scaling = shard_scaling(args.backends.split(","), args.scaling_cells, args.base_shards, args.scaling_shards,
                                args.rounds)
        if args.only == "shards":
            return 0
    with scratch(SERVER, ZOOKEEPER, KAFKA, "tail") as (url, zk, prefix), \
            logstore.open(url, shards=args.shards) as store:
        results: dict[str, Any] = {"cells": args.cells, "shards": args.shards, "shard_scaling": scaling}
        if args.only != "latency":
            results.update(throughput(store, url, zk, prefix, args.cells, args.shards, args.formats.split(",")))
        if args.only != "throughput":
            samples, load = asyncio.run(latency(url, store, zk, prefix, args.rate, args.seconds))
            q = statistics.quantiles(samples, n=100)
            p50, p99 = statistics.median(samples), q[98]
            print(f"latency put_cell -> consumer at {args.rate:.0f} cells/s ({len(samples)} samples): "
                  f"p50 {p50:.1f} ms (<= 20), p99 {p99:.1f} ms (<= 100)")
            results["latency_ms"] = {"rate": args.rate, "samples": len(samples), "p50": p50, "p99": p99}
            results["tailer_process_per_s"] = load
        if args.only is None:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
