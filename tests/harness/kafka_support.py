"""Kafka for the tests: reading topics as an outside consumer would, with kcat (which nobody here wrote) and
aiokafka; deleting a test's topics; publishing a store's cells with the tailer."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

import logstore
from tailer.config import KafkaOptions, TailerConfig
from tailer.coordinators.store import StoreCoordinator
from tailer.publishers.kafka import KafkaPublisher
from tailer.security import PLAINTEXT, KafkaSecurity
from tailer.worker import Tailer
from tests.harness.shared_servers import KAFKA


class Msg(NamedTuple):
    partition: int
    offset: int
    key: str
    headers: dict[str, str]
    value: Any


def kcat() -> str:
    path = shutil.which("kcat")
    if path is None:
        pytest.fail("kcat is not installed; run the suite with `make test`, which installs it", pytrace=False)
    return path


def require_kafka(brokers: str) -> None:
    result = subprocess.run([kcat(), "-b", brokers, "-L", "-m", "5"], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.fail(f"Kafka is not reachable at {brokers} ({result.stderr.strip()[:200]}); run the suite with "
                    "`make test`, which installs and starts it", pytrace=False)


def topics(brokers: str) -> list[str]:
    out = subprocess.run([kcat(), "-b", brokers, "-L", "-J"], capture_output=True, text=True, timeout=30, check=True)
    return [t["topic"] for t in json.loads(out.stdout)["topics"]]


def delete_topics(brokers: str, prefix: str) -> None:
    async def run() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=brokers)
        await admin.start()
        try:
            names = [t for t in await admin.list_topics() if t.startswith(prefix)]
            if names:
                await admin.delete_topics(names)
        finally:
            await admin.close()
    asyncio.run(run())


def kcat_read(brokers: str, topic: str, config: str | None = None) -> list[Msg]:
    """Every message of the topic, read by kcat from the beginning to the current end (with ``config``, a
    properties file given to kcat -F: TLS and SASL)."""
    try:
        result = subprocess.run([kcat(), *(["-F", config] if config else []), "-C", "-b", brokers, "-t", topic,
                                 "-o", "beginning", "-e", "-J", "-q"],
                                capture_output=True, text=True, timeout=15)
        stdout = result.stdout
        if result.returncode != 0:
            if "Unknown topic" in result.stderr or "UNKNOWN_TOPIC" in result.stderr:
                return []
            raise AssertionError(f"kcat failed: {result.stderr[:500]}")
    except subprocess.TimeoutExpired as exc:
        # While producers keep writing, -e may wait long for every partition to be at its end at
        # once: take what was read (whole lines) and let the caller read again.
        raw = exc.stdout or b""
        stdout = raw.decode() if isinstance(raw, bytes) else raw
        stdout = stdout[: stdout.rfind("\n") + 1]
    out = []
    for line in stdout.splitlines():
        m = json.loads(line)
        flat = m.get("headers") or []
        headers = dict(zip(flat[::2], flat[1::2], strict=True))
        payload = m["payload"]
        out.append(Msg(m["partition"], m["offset"], m["key"], headers, json.loads(payload) if payload else None))
    return out


def cell_ids(messages: Iterable[Msg]) -> list[tuple[int, int]]:
    return [(int(m.headers["shard"]), int(m.headers["added_id"])) for m in messages]


def wait_for(brokers: str, topic: str, expected: set[tuple[int, int]], timeout: float = 90.0) -> list[Msg]:
    """kcat reads until every expected (shard, added_id) is on the topic."""
    deadline = time.monotonic() + timeout
    while True:
        messages = kcat_read(brokers, topic)
        missing = expected - set(cell_ids(messages))
        if not missing:
            return messages
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(missing)} of {len(expected)} cells never reached {topic}, "
                                 f"e.g. {sorted(missing)[:5]}")
        time.sleep(0.5)


def assert_shard_order(messages: list[Msg], partitions: int) -> dict[int, list[int]]:
    """Each shard's first deliveries come in added_id order, on partition shard mod P; replays may repeat."""
    seen: dict[int, list[int]] = {}
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        shard, added_id = int(m.headers["shard"]), int(m.headers["added_id"])
        assert m.partition == shard % partitions
        ids = seen.setdefault(shard, [])
        if added_id in ids:
            continue
        assert not ids or added_id > ids[-1], f"shard {shard}: {added_id} arrived after {ids[-1]}"
        ids.append(added_id)
    return seen


async def aiokafka_read(brokers: str, topic: str, partitions: int, expect: int, timeout: float = 60.0) -> list[Msg]:
    consumer = AIOKafkaConsumer(bootstrap_servers=brokers, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        out: list[Msg] = []
        deadline = time.monotonic() + timeout
        while len(out) < expect and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for r in records:
                    headers = {k: v.decode() for k, v in r.headers}
                    out.append(Msg(r.partition, r.offset, r.key.decode() if r.key else "", headers,
                                   json.loads(r.value) if r.value else None))
        return out
    finally:
        await consumer.stop()


def publish(store: logstore.Store, prefix: str, partitions: int = 4, timeout: float = 60,
            brokers: str = KAFKA, security: KafkaSecurity = PLAINTEXT,
            value_format: Literal["json", "msgpack"] = "json") -> None:
    """Run the tailer until every cell now in the store is on Kafka (topics <prefix>.<column>)."""
    async def run() -> None:
        config = TailerConfig(name=f"{prefix}-tailer", topic_prefix=prefix, partitions=partitions,
                              commit_interval=0.2, value_format=value_format)
        publisher = KafkaPublisher(KafkaOptions(brokers=brokers, security=security))
        tailer = Tailer(store, config, StoreCoordinator(store, config.name), publisher)
        await tailer.start()
        since = time.monotonic()
        try:
            deadline = since + timeout
            while not tailer.caught_up(since):
                assert tailer.error is None, tailer.error
                assert time.monotonic() < deadline, "the tailer did not publish everything in time"
                await asyncio.sleep(0.05)
        finally:
            await tailer.stop()
    asyncio.run(run())
