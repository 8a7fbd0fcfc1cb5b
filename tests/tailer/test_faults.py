"""Faults the tailer must survive, against real servers: SIGKILL of a worker, a Kafka broker restart,
ZooKeeper down for 20 s. Workers run as real `cellstream tail` processes where a process must die."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

import logstore
from tailer.config import KafkaOptions, TailerConfig
from tailer.coordinators.zookeeper import ZooKeeperCoordinator, tailer_path
from tailer.publishers.kafka import KafkaPublisher
from tailer.worker import Tailer
from tests.harness.kafka_support import assert_shard_order, cell_ids, kcat_read, wait_for
from tests.harness.services import PrivateKafka, PrivateZooKeeper, free_port
from tests.harness.shared_servers import KAFKA

SHARDS = 12
P = 4


class Writer:
    """Puts cells at a steady rate from a thread until stopped; remembers what it wrote."""

    def __init__(self, store: logstore.Store, rate: float = 150.0) -> None:
        self.store, self.rate = store, rate
        self.cells: list[logstore.Cell] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = [(uuid.uuid4(), "BASE", 1, {"at": time.time()}) for _ in range(5)]
            self.cells.extend(self.store.put_cells(batch))
            time.sleep(5 / self.rate)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def ids(self) -> set[tuple[int, int]]:
        return {(c.shard, c.added_id) for c in self.cells}


class Worker:
    """One `cellstream tail` process."""

    def __init__(self, tmp: Path, store_url: str, zk: str, prefix: str, name: str, session: float,
                 brokers: str = KAFKA) -> None:
        self.metrics_port = free_port()
        self.log = tmp / f"worker-{uuid.uuid4().hex[:6]}.log"
        args = [sys.executable, "-m", "cellstream", "tail", "--store", store_url, "--brokers", brokers,
                "--zookeeper", zk, "--name", name, "--prefix", prefix, "--partitions", str(P),
                "--session-timeout", str(session), "--metrics-port", str(self.metrics_port)]
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.poll()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


def zk_state(zk: str, name: str) -> dict[str, Any]:
    hosts, root = tailer_path(zk, name)
    client = KazooClient(hosts=hosts)
    client.start(timeout=30)
    try:
        members = client.get_children(f"{root}/workers") if client.exists(f"{root}/workers") else []
        raw = client.get(f"{root}/assignment")[0] if client.exists(f"{root}/assignment") else b"{}"
        claims = {}
        for c in client.get_children(f"{root}/claims") if client.exists(f"{root}/claims") else []:
            try:  # claims come and go while shards move
                claims[int(c)] = json.loads(client.get(f"{root}/claims/{c}")[0])["worker"]
            except NoNodeError:
                continue
        offsets = {int(s): json.loads(client.get(f"{root}/offsets/{s}")[0])
                   for s in (client.get_children(f"{root}/offsets") if client.exists(f"{root}/offsets") else [])}
        return {"members": members, "assignment": json.loads(raw or b"{}"), "claims": claims, "offsets": offsets}
    finally:
        client.stop()
        client.close()


def wait_until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def claims_by_pid(state: dict[str, Any]) -> Counter[int]:
    return Counter(int(member.rsplit("/", 1)[1].split(".")[1]) for member in state["claims"].values())


def test_sigkill_of_one_of_three_workers_moves_its_shards_and_loses_nothing(
    mysql_database: str, zk_chroot: str, topic_prefix: str, tmp_path: Path, workers: list[Worker]
) -> None:
    store = logstore.open(mysql_database, shards=SHARDS)
    name = "killed"
    with Writer(store) as writer:
        workers.extend(Worker(tmp_path, mysql_database, zk_chroot, topic_prefix, name, session=5) for _ in range(3))
        state = wait_until(lambda: (s := zk_state(zk_chroot, name)) and len(claims_by_pid(s)) == 3
                           and len(s["claims"]) == SHARDS and s, 90, "three workers publishing every shard")
        victim = workers[1]
        wait_until(lambda: "cellstream_tailer_lag_cells" in victim.metrics(), 30, "the victim's lag metrics")
        time.sleep(2)
        before = zk_state(zk_chroot, name)
        victim_shards = {s for s, w in before["claims"].items() if f".{victim.proc.pid}." in w}
        assert len(victim_shards) == SHARDS // 3
        committed = {s: before["offsets"][s]["location"] for s in victim_shards}
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        # Its shards move once its session expires; cells keep coming meanwhile.
        state = wait_until(lambda: (s := zk_state(zk_chroot, name)) and len(s["claims"]) == SHARDS
                           and all(f".{victim.proc.pid}." not in w for w in s["claims"].values()) and s,
                           60, "the dead worker's shards to move")
        assert len(claims_by_pid(state)) == 2
        time.sleep(2)
        writer.stop()
    messages = wait_for(KAFKA, f"{topic_prefix}.BASE", writer.ids, timeout=120)
    assert_shard_order(messages, P)
    counts = Counter(cell_ids(messages))
    for (shard, added_id), n in counts.items():
        if n > 1:  # only the dead worker's uncommitted window may be published twice
            assert shard in victim_shards and added_id > committed[shard], (shard, added_id, n)
    assert set(counts) == writer.ids
    assert workers[0].stop() == 0 and workers[2].stop() == 0
    store.close()


def test_a_kafka_broker_restart_loses_nothing_and_the_worker_recovers_by_itself(
    mysql_database: str, zk_chroot: str, tmp_path: Path
) -> None:
    store = logstore.open(mysql_database, shards=SHARDS)
    prefix = f"r{uuid.uuid4().hex[:8]}"
    with PrivateKafka(tmp_path / "kafka") as kafka:
        config = TailerConfig(name="restart", topic_prefix=prefix, partitions=P, session_timeout=10)
        coordinator = ZooKeeperCoordinator(zk_chroot, "restart", SHARDS, session_timeout=10)
        publisher = KafkaPublisher(KafkaOptions(brokers=kafka.bootstrap, request_timeout_ms=10_000))
        tailer = Tailer(store, config, coordinator, publisher)

        async def scenario() -> set[tuple[int, int]]:
            async with tailer:
                with Writer(store) as writer:
                    await asyncio.sleep(1)
                    await asyncio.to_thread(wait_for, kafka.bootstrap, f"{prefix}.BASE", writer.ids, 60)
                    await asyncio.to_thread(kafka.stop)
                    await asyncio.sleep(3)  # cells written while the broker is down
                    await asyncio.to_thread(kafka.start)
                    await asyncio.sleep(3)
                    writer.stop()
                    await asyncio.to_thread(wait_for, kafka.bootstrap, f"{prefix}.BASE", writer.ids, 120)
                    assert tailer.error is None and tailer._task is not None and not tailer._task.done()
                    return writer.ids
        ids = asyncio.run(scenario())
        messages = kcat_read(kafka.bootstrap, f"{prefix}.BASE")
        assert set(cell_ids(messages)) == ids
        assert_shard_order(messages, P)
    store.close()


def test_zookeeper_down_for_20s_publishing_continues_and_a_new_worker_gets_shards_after(
    mysql_database: str, topic_prefix: str, tmp_path: Path, workers: list[Worker]
) -> None:
    store = logstore.open(mysql_database, shards=SHARDS)
    name = "zkdown"
    with PrivateZooKeeper(tmp_path / "zk") as zk:
        hosts = zk.hosts + "/cst"
        workers.extend(Worker(tmp_path, mysql_database, hosts, topic_prefix, name, session=30) for _ in range(2))
        wait_until(lambda: (s := zk_state(hosts, name)) and len(s["claims"]) == SHARDS
                   and len(claims_by_pid(s)) == 2, 90, "two workers publishing every shard")
        zk.stop()
        stopped = time.monotonic()
        during = store.put_cells([(uuid.uuid4(), "BASE", 1, {"during": i}) for i in range(60)])
        wait_for(KAFKA, f"{topic_prefix}.BASE", {(c.shard, c.added_id) for c in during}, timeout=15)
        workers.append(Worker(tmp_path, mysql_database, hosts, topic_prefix, name, session=30))
        time.sleep(max(0.0, 20 - (time.monotonic() - stopped)))
        assert all(w.proc.poll() is None for w in workers)
        zk.start()
        newcomer = workers[2].proc.pid
        state = wait_until(lambda: (s := zk_state(hosts, name)) and claims_by_pid(s)[newcomer] == SHARDS // 3
                           and len(s["claims"]) == SHARDS and s, 90, "the new worker to get its shards")
        assert len(claims_by_pid(state)) == 3
        after = store.put_cells([(uuid.uuid4(), "BASE", 1, {"after": i}) for i in range(60)])
        every = {(c.shard, c.added_id) for c in during + after}
        messages = wait_for(KAFKA, f"{topic_prefix}.BASE", every, timeout=60)
        assert_shard_order(messages, P)
        assert [w.stop() for w in workers] == [0, 0, 0]
    store.close()


def test_a_worker_cut_off_from_zookeeper_beyond_its_lease_stops_publishing_until_it_is_back(
    mysql_database: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Fencing in time: with a 4 s session the lease ends 3.2 s after the last answer, before the
    server could expire the session and hand the shards to someone else."""
    store = logstore.open(mysql_database, shards=SHARDS)
    with PrivateZooKeeper(tmp_path / "zk") as zk:
        config = TailerConfig(name="lease", topic_prefix=topic_prefix, partitions=P, session_timeout=4)
        tailer = Tailer(store, config, ZooKeeperCoordinator(zk.hosts, "lease", SHARDS, session_timeout=4),
                        KafkaPublisher(KafkaOptions(brokers=KAFKA)))

        async def scenario() -> None:
            async with tailer:
                while len(tailer.owned) < SHARDS:
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(zk.stop)
                await asyncio.sleep(4.5)
                assert not tailer.coordinator.lease_valid()
                held = store.put_cells([(uuid.uuid4(), "BASE", 1, {"held": i}) for i in range(20)])
                await asyncio.sleep(2)
                published = await asyncio.to_thread(kcat_read, KAFKA, f"{topic_prefix}.BASE")
                assert not set(cell_ids(published)) & {(c.shard, c.added_id) for c in held}
                assert tailer.metrics.lease_valid.labels("lease")._value.get() == 0
                await asyncio.to_thread(zk.start)
                await asyncio.to_thread(wait_for, KAFKA, f"{topic_prefix}.BASE",
                                        {(c.shard, c.added_id) for c in held}, 60)
                assert len(tailer.owned) == SHARDS  # the session survived the restart: same shards
        asyncio.run(scenario())
    store.close()
