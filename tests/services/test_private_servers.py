"""The private-server harness (tests/harness/services.py): ZooKeeper and Kafka that keep their data across
kills and restarts, on the ports they were given."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from kazoo.client import KazooClient

from tests.harness.services import PrivateKafka, PrivateZooKeeper, kafka_brokers, zk_four_letter


def kcat() -> str:
    path = shutil.which("kcat")
    if path is None:
        pytest.fail("kcat is not installed; run the suite with `make test`, which installs it", pytrace=False)
    return path


def zk_get(hosts: str, path: str) -> bytes:
    client = KazooClient(hosts=hosts, timeout=10)
    client.start(timeout=30)
    try:
        data, _stat = client.get(path)
        assert isinstance(data, bytes)
        return data
    finally:
        client.stop()
        client.close()


def create_topic(bootstrap: str, topic: str) -> None:
    async def run() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        finally:
            await admin.close()

    asyncio.run(run())


def produce(bootstrap: str, topic: str, *messages: str) -> None:
    subprocess.run(
        [kcat(), "-P", "-b", bootstrap, "-t", topic, "-X", "acks=all"],
        input="".join(f"{m}\n" for m in messages), text=True, check=True, timeout=60,
    )


def consume_all(bootstrap: str, topic: str, expected: int, timeout: float = 60.0) -> list[str]:
    """Every message of the topic from the beginning; retried while the partition has no leader yet."""
    deadline = time.monotonic() + timeout
    while True:
        result = subprocess.run(
            [kcat(), "-C", "-b", bootstrap, "-t", topic, "-o", "beginning", "-e", "-q"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        messages = result.stdout.splitlines()
        if (result.returncode == 0 and len(messages) >= expected) or time.monotonic() > deadline:
            return messages
        time.sleep(0.5)


def test_private_zookeeper_keeps_nodes_across_restart_and_kill(tmp_path: Path) -> None:
    with PrivateZooKeeper(tmp_path / "zk") as zk:
        assert zk_four_letter(zk.hosts, "ruok") == "imok"
        client = KazooClient(hosts=zk.hosts, timeout=10)
        client.start(timeout=30)
        client.create("/cellstream/probe", b"v1", makepath=True)
        client.stop()
        client.close()
        port = zk.port

        zk.restart()
        assert zk.port == port
        assert zk_get(zk.hosts, "/cellstream/probe") == b"v1"

        zk.kill()
        assert not zk.running
        assert zk_four_letter(zk.hosts, "ruok") == ""
        zk.start()
        assert zk_get(zk.hosts, "/cellstream/probe") == b"v1"
    assert not zk.running
    zk.stop()  # stopping twice is harmless


def test_private_kafka_keeps_messages_across_kill_and_restart(tmp_path: Path) -> None:
    with PrivateKafka(tmp_path / "kafka") as kafka:
        create_topic(kafka.bootstrap, "harness")
        produce(kafka.bootstrap, "harness", "hello")
        assert consume_all(kafka.bootstrap, "harness", 1) == ["hello"]

        kafka.kill()
        assert not kafka.running
        assert kafka_brokers(kafka.bootstrap, timeout=2) == []
        kafka.start()
        assert consume_all(kafka.bootstrap, "harness", 1) == ["hello"]

        # A clean stop and an immediate start on the same ports.
        kafka.restart()
        produce(kafka.bootstrap, "harness", "world")
        assert consume_all(kafka.bootstrap, "harness", 2) == ["hello", "world"]
    assert not kafka.running
    kafka.stop()
