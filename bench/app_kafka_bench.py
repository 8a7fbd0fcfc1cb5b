"""Stream-processing runtime benchmark, Kafka mode (python bench/app_kafka_bench.py [--shards N]).

Needs the MariaDB, ZooKeeper and Kafka of ``make services-up``. Both parts' stores have
``--shards`` shards (default 4096, the store's default).

1. Latency, set up like bench/tailer_bench.py: a fresh MariaDB database, a tailer
   worker process (``cellstream tail`` with ZooKeeper; the consumer starts once it has
   claimed every shard), eight writer threads putting cells at ``--rate`` (1,000)
   cells/s for ``--seconds``. A consumer process notes when each cell
   reaches it; latency is from put_cell returning to that moment, the warm-up tenth
   dropped. The consumer is, in turn, the app in Kafka mode (a no-op async handler:
   put_cell -> tailer -> Kafka -> the app's consumer group -> handler; target p99 <= 100 ms), a plain
   aiokafka group consumer decoding the same cells, and a bare faust agent doing the
   same, each on its own column, so the runtime's share can be told from the rest.
2. Throughput: ``--cells`` cells are published first (16 partitions). In the same run
   the topic is read by (a) raw aiokafka (``getmany`` over every partition, decoding
   each cell), (b) a bare faust agent acknowledging each event, (c) the app with a no-op
   handler (decode, handler, settling, commits) and (d) the app with a no-op batch
   handler (``@app.batch_trigger``); each is timed from its first message to its last (so
   connecting and the group join are left out). The targets are (c)/(a) >= 0.5 and
   (d)/(a) >= 0.7.

Results go to bench/results/app_kafka.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
from bench.pacing import latencies, paced_puts
from bench.scratch import scratch, wait_claimed
from indexer import App
from logstore import Cell
from tailer.config import KafkaOptions, TailerConfig
from tailer.coordinators.store import StoreCoordinator
from tailer.messages import decode_cell
from tailer.publishers.kafka import KafkaPublisher
from tailer.worker import Tailer
from tests.harness.shared_servers import KAFKA, ZOOKEEPER
from tests.harness.shared_servers import MYSQL_SERVER as SERVER

P = 16
CONSUMERS = ("app", "aiokafka", "faust")


def group(prefix: str, consumer: str) -> str:
    return f"app.{prefix}-{consumer}" if consumer == "app" else f"{prefix}-{consumer}"


# -- latency ------------------------------------------------------------------------------
def consume_latency(prefix: str, consumer: str, column: str, seconds: float, shards: int) -> None:
    """(the consumer process) Print {row_key: receipt time} as JSON once ``seconds`` have passed."""
    got: dict[str, float] = {}
    topic = f"{prefix}.{column}"

    def seen(cell: Cell) -> None:
        got.setdefault(str(cell.row_key), time.time())

    async def app_mode() -> None:
        with tempfile.TemporaryDirectory() as tmp, logstore.open(f"sqlite:///{tmp}/dlq", shards=shards) as store:
            app = App(f"{prefix}-app", store=store, brokers=KAFKA, topic_prefix=prefix)

            @app.trigger(column)
            async def noop(cell: Cell) -> None:
                seen(cell)

            stop = asyncio.Event()
            running = asyncio.create_task(app.run_async(stop))
            await asyncio.sleep(seconds)
            stop.set()
            await running
            app.close()

    async def aiokafka_mode() -> None:
        kafka = AIOKafkaConsumer(topic, bootstrap_servers=KAFKA, group_id=group(prefix, consumer),
                                 auto_offset_reset="earliest")
        await kafka.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for records in (await kafka.getmany(timeout_ms=50)).values():
                for r in records:
                    seen(decode_cell(r.value, list(r.headers)))
        await kafka.stop()

    async def faust_mode() -> None:
        import faust

        with tempfile.TemporaryDirectory() as datadir:
            app = faust.App(group(prefix, consumer), broker=f"kafka://{KAFKA}", web_enabled=False, datadir=datadir,
                            autodiscover=False, topic_disable_leader=True)

            @app.agent(app.topic(topic, value_serializer="raw", key_serializer="raw"))
            async def agent(stream: Any) -> None:
                async for event in stream.noack().events():
                    seen(decode_cell(event.message.value, event.message.headers))
                    event.ack()

            await app.start()
            await asyncio.sleep(seconds)
            await app.stop()

    asyncio.run({"app": app_mode, "aiokafka": aiokafka_mode, "faust": faust_mode}[consumer]())
    print(json.dumps(got), flush=True)


async def _group_state(name: str) -> tuple[str, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
    await admin.start()
    try:
        [response] = await admin.describe_consumer_groups([name])
        state, members = response.groups[0][2], response.groups[0][5]
        return state, len(members)
    finally:
        await admin.close()


def latency(store: logstore.Store, url: str, zk: str, prefix: str, consumer: str, rate: float,
            seconds: float) -> list[float]:
    column, name = f"LAT_{consumer.upper()}", f"latency-{consumer}"
    tailer = subprocess.Popen(
        [sys.executable, "-m", "cellstream", "tail", "--store", url, "--brokers", KAFKA, "--zookeeper", zk,
         "--name", name, "--prefix", prefix, "--partitions", str(P), "--columns", column,
         "--from", "now"], stderr=subprocess.DEVNULL)
    reader = None
    try:
        deadline = time.monotonic() + 60
        while not asyncio.run(_topic_exists(f"{prefix}.{column}")):  # the tailer creates it on start
            assert time.monotonic() < deadline and tailer.poll() is None, "the tailer did not start"
            time.sleep(0.2)
        # Before the consumer starts, so that its window (--seconds) is not spent waiting for the claims.
        wait_claimed(zk, name, store.shard_count, tailer, 180)
        deadline = time.monotonic() + 60
        reader = subprocess.Popen([sys.executable, __file__, "--consume", consumer, "--prefix", prefix,
                                   "--column", column, "--seconds", str(seconds + 12),
                                   "--shards", str(store.shard_count)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        while asyncio.run(_group_state(group(prefix, consumer))) != ("Stable", 1):
            assert time.monotonic() < deadline and reader.poll() is None, "the consumer did not join its group"
            time.sleep(0.2)
        time.sleep(2)  # positioned and fetching; the tailer has claimed its shards
        put_at = paced_puts(store, column, rate, seconds, lambda _i: {"city": "Aarhus", "fare": 12.5})
        got: dict[str, float] = json.loads(reader.communicate(timeout=120)[0])
    finally:
        for proc in (reader, tailer):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    return latencies(put_at, got, consumer)


async def _topic_exists(topic: str) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
    await admin.start()
    try:
        return topic in await admin.list_topics()
    finally:
        await admin.close()


# -- throughput -----------------------------------------------------------------------------
class _Clock:
    """Message count and the times of the first and last message."""

    def __init__(self) -> None:
        self.count, self.first, self.last = 0, 0.0, 0.0

    def tick(self) -> None:
        now = time.perf_counter()
        if not self.first:
            self.first = now
        self.count += 1
        self.last = now

    @property
    def rate(self) -> float:
        return self.count / (self.last - self.first)


def publish(store: logstore.Store, prefix: str) -> None:
    async def run() -> None:
        config = TailerConfig(name=f"{prefix}-publish", topic_prefix=prefix, partitions=P)
        tailer = Tailer(store, config, StoreCoordinator(store, config.name),
                        KafkaPublisher(KafkaOptions(brokers=KAFKA)))
        await tailer.start()
        since = time.monotonic()
        while not tailer.caught_up(since):
            assert tailer.error is None, tailer.error
            await asyncio.sleep(0.05)
        await tailer.stop()
    asyncio.run(run())


async def raw_aiokafka(topic: str, expected: int) -> float:
    consumer = AIOKafkaConsumer(bootstrap_servers=KAFKA, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    clock = _Clock()
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(P)])
        while clock.count < expected:  # timed like the others: from the first record to the last
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    decode_cell(record.value, list(record.headers))
                    clock.tick()
    finally:
        await consumer.stop()
    return clock.rate


async def bare_faust(prefix: str, topic: str, expected: int) -> float:
    import faust

    with tempfile.TemporaryDirectory() as datadir:
        app = faust.App(f"{prefix}-bare-faust", broker=f"kafka://{KAFKA}", web_enabled=False, datadir=datadir,
                        autodiscover=False, topic_disable_leader=True)
        clock = _Clock()

        @app.agent(app.topic(topic, value_serializer="raw", key_serializer="raw"))
        async def count(stream: Any) -> None:
            async for event in stream.noack().events():
                clock.tick()
                event.ack()

        await app.start()
        while clock.count < expected:
            await asyncio.sleep(0.05)
        await app.stop()
    return clock.rate


def app_throughput(store: logstore.Store, prefix: str, expected: int, batch: bool = False) -> float:
    app = App(f"{prefix}-throughput{'-batch' if batch else ''}", store=store, brokers=KAFKA, topic_prefix=prefix)
    clock = _Clock()

    if batch:
        @app.batch_trigger("TPUT")
        async def noop_batch(cells: list[Cell]) -> None:
            for _ in cells:
                clock.tick()
    else:
        @app.trigger("TPUT")
        async def noop(cell: Cell) -> None:
            clock.tick()

    counts = app.drain(timeout=900)
    app.close()
    assert counts.processed == expected, counts
    return clock.rate


def throughput(prefix: str, cells: int, shards: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cellstream-bench-") as tmp, \
            logstore.open(f"sqlite:///{tmp}/store", shards=shards) as store:
        for start in range(0, cells, 1000):
            store.put_cells([(uuid.uuid4(), "TPUT", 1, {"n": n, "city": "Aarhus", "fare": 12.5})
                             for n in range(start, min(cells, start + 1000))])
        publish(store, prefix)
        raw = asyncio.run(raw_aiokafka(f"{prefix}.TPUT", cells))
        bare = asyncio.run(bare_faust(prefix, f"{prefix}.TPUT", cells))
        handled = app_throughput(store, prefix, cells)
        batched = app_throughput(store, prefix, cells, batch=True)
    return {"cells": cells, "partitions": P, "raw_aiokafka_per_s": round(raw), "bare_faust_per_s": round(bare),
            "app_cells_per_s": round(handled), "ratio_vs_raw_aiokafka": round(handled / raw, 3),
            "app_batch_cells_per_s": round(batched), "batch_ratio_vs_raw_aiokafka": round(batched / raw, 3),
            "ratio_vs_bare_faust": round(handled / bare, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--cells", type=int, default=30_000)
    parser.add_argument("--shards", type=int, default=4096, help="shards of the stores (default 4096, the store's)")
    parser.add_argument("--only", choices=["latency", "throughput"], help="run one part (results not saved)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "app_kafka.json"))
    parser.add_argument("--consume", choices=CONSUMERS, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--column", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.consume:
        consume_latency(args.prefix, args.consume, args.column, args.seconds, args.shards)
        return 0
    result: dict[str, Any] = {"shards": args.shards, "partitions": P}
    with scratch(SERVER, ZOOKEEPER, KAFKA, "app") as (url, zk, prefix):
        if args.only in (None, "latency"):
            with logstore.open(url, shards=args.shards) as store:
                for consumer in CONSUMERS:
                    samples = latency(store, url, zk, prefix, consumer, args.rate, args.seconds)
                    q = statistics.quantiles(samples, n=100)
                    lat = {"samples": len(samples), "p50_ms": round(statistics.median(samples), 1),
                           "p99_ms": round(q[98], 1), "max_ms": round(max(samples), 1)}
                    result[f"latency_{consumer}"] = lat
                    print(f"latency put_cell -> {consumer} at {args.rate:.0f} cells/s ({lat['samples']} "
                          f"samples): p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms", flush=True)
            p99 = result["latency_app"]["p99_ms"]
            print(f"Kafka-mode target p99 <= 100 ms: {'met' if p99 <= 100 else 'MISSED'}")
        if args.only in (None, "throughput"):
            tput = result["throughput"] = throughput(prefix, args.cells, args.shards)
            print(f"throughput, no-op handler: {tput['app_cells_per_s']} cells/s; raw aiokafka "
                  f"{tput['raw_aiokafka_per_s']}/s (ratio {tput['ratio_vs_raw_aiokafka']}, target >= 0.5: "
                  f"{'met' if tput['ratio_vs_raw_aiokafka'] >= 0.5 else 'MISSED'}); bare faust "
                  f"{tput['bare_faust_per_s']}/s (ratio {tput['ratio_vs_bare_faust']})")
            print(f"throughput, no-op batch handler: {tput['app_batch_cells_per_s']} cells/s (ratio "
                  f"{tput['batch_ratio_vs_raw_aiokafka']}, target >= 0.7: "
                  f"{'met' if tput['batch_ratio_vs_raw_aiokafka'] >= 0.7 else 'MISSED'})")
    if args.only is None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
