"""The stream-processing runtime in Kafka mode, against the real Kafka of `make test`.

The whole pipeline runs: cells are written to a SQLite store, the tailer publishes
them to Kafka (offsets in the store), and the app consumes the topics with its
consumer group (librdkafka's consumer). The DLQ topic and the group's committed offsets are read back with kcat and
aiokafka's admin client, not through the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

import logstore
from indexer import App, ConfigurationError, HandlerStalledError, SourceUnavailableError
from logstore.retry import RetryPolicy
from tailer.messages import encode_deadletter
from tests.harness.app_thread import app_in_thread
from tests.harness.app_worker import kill_mid_handler_then_drain
from tests.harness.kafka_support import kcat_read, publish
from tests.harness.shared_servers import KAFKA

SHARDS = 8
P = 4  # the partitions publish() makes
FAST = RetryPolicy(initial=0.001, maximum=0.005, deadline=None)


def write(store: logstore.Store, n: int, column: str = "BASE", **extra: Any) -> list[logstore.Cell]:
    return store.put_cells([(uuid.uuid4(), column, 1, {"n": i, **extra}) for i in range(n)])


def committed(group: str) -> dict[tuple[str, int], int]:
    async def run() -> dict[tuple[str, int], int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(group)
            return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()}
        finally:
            await admin.close()
    return asyncio.run(run())


def end_offsets(topic: str) -> dict[tuple[str, int], int]:
    async def run() -> dict[tuple[str, int], int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=KAFKA, enable_auto_commit=False)
        await consumer.start()
        try:
            found = await consumer.end_offsets([TopicPartition(topic, p) for p in range(P)])
            return {(tp.topic, tp.partition): offset for tp, offset in found.items()}
        finally:
            await consumer.stop()
    return asyncio.run(run())


def produce(topic: str, partition: int, key: bytes, value: bytes) -> None:
    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=KAFKA, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, value, key=key, partition=partition)
        finally:
            await producer.stop()
    asyncio.run(run())


def test_poison_cells_are_dead_lettered_with_their_kafka_position_mirrored_and_processing_goes_on(
    store: logstore.Store, topic_prefix: str
) -> None:
    good = write(store, 150)
    poison = write(store, 3, poison=True)
    good += write(store, 50)
    publish(store, topic_prefix)
    # A message no tailer wrote: it must reach the DLQ too, not be skipped or crash the app.
    produce(f"{topic_prefix}.BASE", 1, b"not-a-uuid", b"\xff not json")
    # A cell the tailer gave up on (its dead-letter record): each BASE handler dead-letters it.
    lost = store.put_cell(uuid.uuid4(), "BASE", 1, {"n": -1})
    record = encode_deadletter(lost.coordinates(), topic=f"{topic_prefix}.BASE", error=ValueError("body too large"),
                               stage="encode", tailer="tl", worker="w1")
    produce(f"{topic_prefix}-deadletter", lost.shard % P, record.key, record.value)
    # A garbled record there: whose cell it was is unknown, so every handler gets an entry.
    produce(f"{topic_prefix}-deadletter", 0, b"junk", b"[1, 2]")

    seen: list[logstore.Cell] = []
    active: dict[int, int] = defaultdict(int)
    overlap: list[int] = []
    lock = threading.Lock()
    app = App(f"{topic_prefix}-app", store=store, brokers=KAFKA, topic_prefix=topic_prefix, backoff=FAST)

    @app.trigger("BASE", max_attempts=2)
    def bill(cell: logstore.Cell) -> None:
        with lock:
            active[cell.shard % P] += 1
            if active[cell.shard % P] > 1:
                overlap.append(cell.shard)
        try:
            time.sleep(0.001)
            if cell.body.get("poison"):
                raise ValueError(f"card declined for {cell.row_key}")
            with lock:
                seen.append(cell)
        finally:
            with lock:
                active[cell.shard % P] -= 1

    with app:
        counts = app.drain(timeout=90)
        # 3 poison cells retried once each; they, the foreign message and both tailer dead letters dead-lettered
        assert counts == (200, 3, 6)
        assert overlap == [], "two cells of one partition were handled at once"
        by_shard: dict[int, list[int]] = defaultdict(list)
        for cell in seen:
            by_shard[cell.shard].append(cell.added_id)
        assert all(ids == sorted(ids) for ids in by_shard.values()), "a shard's cells were handled out of order"
        assert {(c.shard, c.added_id) for c in seen} == {(c.shard, c.added_id) for c in good}

        entries = {e.cell.get("row_key"): e for e in app.dlq.list()}
        assert len(entries) == 6
        garbled = entries["junk"]
        assert garbled.source["topic"] == f"{topic_prefix}-deadletter" and garbled.column == "BASE"
        assert "not a tailer dead-letter record" in garbled.message
        tailer_gave_up = entries[str(lost.row_key)]
        assert tailer_gave_up.body is None and tailer_gave_up.error_type == "ValueError"
        assert tailer_gave_up.source["topic"] == f"{topic_prefix}-deadletter"
        assert tailer_gave_up.cell["added_id"] == lost.added_id
        for cell in poison:
            entry = entries[str(cell.row_key)]
            assert entry.handler == "bill" and entry.error_type == "ValueError" and entry.attempts == 2
            assert entry.body == cell.body and entry.status == "open" and "card declined" in entry.message
            assert entry.source["mode"] == "kafka" and entry.source["topic"] == f"{topic_prefix}.BASE"
            assert entry.source["partition"] == cell.shard % P and isinstance(entry.source["offset"], int)
            assert entry.cell["shard"] == cell.shard and entry.cell["added_id"] == cell.added_id
        foreign = entries["not-a-uuid"]
        assert foreign.body is None and foreign.attempts == 1 and foreign.source["partition"] == 1
        assert "undecodable" in foreign.message

        mirrored = kcat_read(KAFKA, f"{topic_prefix}-app.dlq")
        assert {m.key for m in mirrored} == {e.id for e in entries.values()}
        for m in mirrored:
            entry = app.dlq.show(m.key)
            assert m.headers["handler"] == "bill" and m.headers["error_type"] == entry.error_type
            assert m.headers["source_topic"] == entry.source["topic"]
            assert int(m.headers["source_offset"]) == entry.source["offset"]
            assert m.headers["cell_row_key"] == entry.cell["row_key"] and m.headers["status"] == "open"
            assert m.headers["traceback"] and m.value["id"] == entry.id and m.value["body"] == entry.body

        # Offsets advanced past every cell, handled or dead-lettered: nothing comes back.
        ends = end_offsets(f"{topic_prefix}.BASE")
        assert sum(ends.values()) == 204  # the 203 published cells and the foreign message
        group = committed(f"app.{topic_prefix}-app")
        assert {tp: group.get(tp) for tp in ends} == ends
        assert app.drain(timeout=60) == (0, 0, 0)

        foreign_id = foreign.id
        [result] = app.dlq.replay(foreign_id)
        assert result.after == "open" and "names no cell" in (result.error or "")
        assert app.dlq.discard(foreign_id, "garbage from a test producer").status == "discarded"


def test_sigkill_mid_handler_delivers_the_cell_again_from_the_committed_offset(
    store: logstore.Store, sqlite_url: str, tmp_path: Path, topic_prefix: str
) -> None:
    cells = write(store, 40)
    hung = store.put_cell(uuid.uuid4(), "BASE", 1, {"hang": True})
    cells += write(store, 20)
    publish(store, topic_prefix)
    config = {"name": f"{topic_prefix}-killed", "store": sqlite_url, "log": str(tmp_path / "log"),
              "marker": str(tmp_path / "marker"), "brokers": KAFKA, "topic_prefix": topic_prefix,
              "session_timeout": 6}
    killed, lines = kill_mid_handler_then_drain(config)
    again = [(int(s), int(a)) for pid, s, a, _ in lines if pid != str(killed)]
    assert again.count((hung.shard, hung.added_id)) == 1  # delivered again, to the next process
    assert {(int(s), int(a)) for _, s, a, _ in lines} == {(c.shard, c.added_id) for c in [*cells, hung]}
    first: dict[int, list[int]] = defaultdict(list)
    for _, shard, added_id, _ in lines:
        ids = first[int(shard)]
        if int(added_id) not in ids:
            assert not ids or int(added_id) > ids[-1], f"shard {shard} out of order"
            ids.append(int(added_id))
    # The killed process had committed: the next one did not start the partitions from the beginning.
    assert len(again) < len(cells)


def group_members(group: str) -> tuple[str, int]:
    async def run() -> tuple[str, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
        await admin.start()
        try:
            [response] = await admin.describe_consumer_groups([group])
            _error, _name, state, _ptype, _protocol, members = response.groups[0][:6]
            return state, len(members)
        finally:
            await admin.close()
    return asyncio.run(run())


def test_two_workers_share_the_partitions_through_the_consumer_group(
    store: logstore.Store, sqlite_url: str, tmp_path: Path, topic_prefix: str
) -> None:
    write(store, 1)
    publish(store, topic_prefix)  # the topic exists before the workers subscribe
    log = tmp_path / "log"
    module = tmp_path / "kapp.py"
    module.write_text(
        "import os\n"
        "from indexer import App\n"
        f"app = App({topic_prefix + '-pair'!r}, store={sqlite_url!r}, brokers={KAFKA!r}, "
        f"topic_prefix={topic_prefix!r}, commit_interval=0.2)\n"
        "@app.trigger('BASE')\n"
        "def record(cell):\n"
        f"    with open({str(log)!r}, 'a') as fh:\n"
        "        fh.write(f'{os.getpid()} {cell.shard} {cell.added_id}\\n')\n"
    )
    # Its own process group, so a failing test takes the worker processes down with the parent.
    proc = subprocess.Popen([sys.executable, "-m", "cellstream", "run", f"{module}:app", "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while group_members(f"app.{topic_prefix}-pair") != ("Stable", 2):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the two workers never formed a stable group"
            time.sleep(0.3)
        cells = write(store, 400)
        publish(store, topic_prefix)
        want = {(c.shard, c.added_id) for c in cells}
        deadline = time.monotonic() + 90
        lines: list[list[str]] = []
        while not want <= {(int(s), int(a)) for _, s, a in lines}:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "some cells were never handled"
            time.sleep(0.2)
            lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
        owners: dict[int, set[str]] = defaultdict(set)
        for pid, shard, added_id in lines:
            if (int(shard), int(added_id)) in want:  # the first cell was handled before the group formed
                owners[int(shard) % P].add(pid)
        assert len({pid for pid, _, _ in lines}) == 2, "one worker did all the work"
        assert all(len(pids) == 1 for pids in owners.values()), f"a partition was handled by both: {owners}"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is empty after a graceful stop
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    ends = end_offsets(f"{topic_prefix}.BASE")
    group = committed(f"app.{topic_prefix}-pair")
    assert {tp: group.get(tp) for tp in ends} == ends  # both stopped gracefully, everything committed


def test_stall_threshold_stops_the_app_before_the_cell_and_a_restart_resumes_there(
    store: logstore.Store, topic_prefix: str
) -> None:
    write(store, 30)
    poison = write(store, 6, poison=True)
    publish(store, topic_prefix)
    broken = {"on": True}
    handled: list[logstore.Cell] = []

    def build() -> App:
        app = App(f"{topic_prefix}-stall", store=store, brokers=KAFKA, topic_prefix=topic_prefix, backoff=FAST,
                  stall_threshold=3)

        @app.trigger("BASE", max_attempts=1)
        def charge(cell: logstore.Cell) -> None:
            if cell.body.get("poison") and broken["on"]:
                raise RuntimeError("provider down")
            handled.append(cell)
        return app

    with build() as app, pytest.raises(HandlerStalledError) as stalled:
        app.drain(timeout=60)
    assert stalled.value.open_entries == 3 and stalled.value.threshold == 3
    broken["on"] = False
    with build() as app:
        counts = app.drain(timeout=60)
        assert counts.dead_lettered == 0
        entries = {e.cell["row_key"] for e in app.dlq.list()}
        assert len(entries) == 3
        # The poison cells not dead-lettered (the stalling one among them) were not acknowledged: they come back.
        assert {str(c.row_key) for c in poison} - entries <= {str(c.row_key) for c in handled}
    ends = end_offsets(f"{topic_prefix}.BASE")
    assert {tp: committed(f"app.{topic_prefix}-stall").get(tp) for tp in ends} == ends


def test_kafka_mode_options_are_checked_and_an_unreachable_cluster_is_a_typed_error(store: logstore.Store) -> None:
    with pytest.raises(ConfigurationError, match="zookeeper"):
        App("both", store=store, brokers=KAFKA, zookeeper="127.0.0.1:2181")
    with pytest.raises(ConfigurationError, match="at a time"):
        App("when", store=store, brokers=KAFKA, start_from="2026-01-01T00:00:00+00:00")
    with pytest.raises(ConfigurationError, match="brokers"):
        App("empty", store=store, brokers=" ")
    app = App("nowhere", store=store, brokers="127.0.0.1:1")
    app.trigger("BASE")(lambda cell: None)
    started = time.monotonic()
    with app, pytest.raises(SourceUnavailableError, match=r"127\.0\.0\.1:1"):
        app.drain(timeout=60)
    assert time.monotonic() - started < 60


def test_a_dead_letter_too_large_for_the_dlq_topic_is_mirrored_without_its_body(
    store: logstore.Store, topic_prefix: str
) -> None:
    big = store.put_cell(uuid.uuid4(), "BASE", 1, {"blob": "x" * 990_000})  # fits a message, not with a traceback
    publish(store, topic_prefix)
    app = App(f"{topic_prefix}-big", store=store, brokers=KAFKA, topic_prefix=topic_prefix, backoff=FAST)

    @app.trigger("BASE", max_attempts=1)
    def refuse(cell: logstore.Cell) -> None:
        raise ValueError("x" * 5000)

    with app:
        assert app.drain(timeout=60) == (0, 0, 1)
        [entry] = app.dlq.list()
        assert entry.body == big.body  # the store keeps everything
    [mirrored] = kcat_read(KAFKA, f"{topic_prefix}-big.dlq")
    assert mirrored.key == entry.id and mirrored.headers["omitted"] == "body,history,traceback"
    assert mirrored.value["body"] is None and mirrored.headers["error_type"] == "ValueError"


def test_an_index_kept_in_kafka_mode_equals_the_brute_force_index(store: logstore.Store, topic_prefix: str,
                                                                  tmp_path: Path) -> None:
    """The index applies each partition's consecutive cells as one batch; a partition holds several shards,
    whose positions are recorded each; redelivery after a restart is skipped by those positions."""
    from tests.harness.index_support import SEED_YAML, actual, expected, seed, trip

    yaml_file = tmp_path / "indexes.yaml"
    yaml_file.write_text(SEED_YAML)
    drivers = [uuid.uuid4() for _ in range(4)]
    rows = [uuid.uuid4() for _ in range(60)]
    store.put_cells([(r, "BASE", 1, trip(drivers[i % 4], drivers[0], i)) for i, r in enumerate(rows)])
    store.put_cells([(rows[0], "BASE", 2, trip(drivers[1], drivers[0], 0)),  # moves to another driver's shard
                     (rows[1], "BASE", 2, {"fare": 1.0})])  # does not fit: dead-lettered
    publish(store, topic_prefix)
    app = App(f"{topic_prefix}-idx", store=store, brokers=KAFKA, topic_prefix=topic_prefix, backoff=FAST)
    with app:
        app.index(yaml_file)
        counts = app.drain(timeout=90)
        [letter] = app.dlq.list()
    assert counts.processed == 61 and counts.dead_lettered == 1
    assert letter.handler == "index:driver_partner_index.v1" and letter.source["topic"] == f"{topic_prefix}.BASE"
    assert actual(store, seed()) == expected(store, seed())
    assert actual(store, seed())[rows[0]][1]["driver_partner_uuid"] == drivers[1]


def test_a_rebalance_hands_a_partition_over_at_its_settled_offset_never_to_two_processes_at_once(
    store: logstore.Store, sqlite_url: str, tmp_path: Path, topic_prefix: str
) -> None:
    # Worker A is busy when B joins: A finishes the page it is on, commits where it got to and lets go; B
    # starts there. No cell is handled twice (A's periodic commits are too rare to help: only the commit on
    # revocation can do it) and no partition is in two handlers' hands at once.
    write(store, 1)
    publish(store, topic_prefix)
    log = tmp_path / "log"
    module = tmp_path / "slowapp.py"
    module.write_text(
        "import os, time\n"
        "from indexer import App\n"
        f"app = App({topic_prefix + '-handover'!r}, store={sqlite_url!r}, brokers={KAFKA!r}, "
        f"topic_prefix={topic_prefix!r}, commit_interval=600, page_size=10)\n"
        "@app.trigger('BASE')\n"
        "def record(cell):\n"
        "    started = time.time()\n"
        "    time.sleep(0.01)\n"
        f"    with open({str(log)!r}, 'a') as fh:\n"
        "        fh.write(f'{os.getpid()} {cell.shard} {cell.added_id} {started} {time.time()}\\n')\n"
    )
    cells = write(store, 2400)  # 10 ms each, 4 partitions at once: about 6 s of work
    publish(store, topic_prefix)
    want = {(c.shard, c.added_id) for c in cells}

    def lines() -> list[list[str]]:
        return [line.split() for line in log.read_text().splitlines()] if log.exists() else []

    def worker() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "cellstream", "run", f"{module}:app"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    first = worker()
    second: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 90
        while len(lines()) < 60:  # A is under way
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.05)
        second = worker()
        while not want <= {(int(s), int(a)) for _, s, a, _, _ in lines()}:
            assert first.poll() is None and second.poll() is None, "a worker died"
            assert time.monotonic() < deadline, "some cells were never handled"
            time.sleep(0.2)
        for proc in (first, second):
            proc.send_signal(signal.SIGTERM)
        for proc in (first, second):
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-2000:]
    finally:
        for proc in (first, second):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    handled = [(pid, int(s), int(a), float(t0), float(t1)) for pid, s, a, t0, t1 in lines()
               if (int(s), int(a)) in want]
    assert len({pid for pid, *_ in handled}) == 2, "B never got a partition"
    assert len(handled) == len(want), "a cell was handled twice: the handover was not at the settled offset"
    spans: dict[int, dict[str, tuple[float, float]]] = defaultdict(dict)
    for pid, shard, _, t0, t1 in handled:
        low, high = spans[shard % P].get(pid, (t0, t1))
        spans[shard % P][pid] = (min(low, t0), max(high, t1))
    for partition, by_pid in spans.items():
        if len(by_pid) == 2:
            (_, first_end), (second_start, _) = sorted(by_pid.values())
            assert first_end <= second_start, f"partition {partition} was handled by both processes at once"


def test_back_pressure_pauses_a_full_partition_and_resumes_it_without_losing_or_reordering_a_cell(
        store: logstore.Store, topic_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for 40 cells in flight, a share of 10 for each of 4 partitions: each is paused while the process
    holds 40 and the partition more than 10, and resumed once worked down, while 600 cells go through a slow
    handler. Pauses and resumes reach the consumer through its polling thread (confluent-kafka serializes calls on
    a handle: one made from the event loop waits for a poll that never ends), and every cell is handled once, in
    its shard's order (librdkafka drops what it prefetched of a paused partition and fetches it again)."""
    from indexer.runtime.group_consumer import GroupConsumer

    cells = write(store, 600)
    publish(store, topic_prefix)
    app = App(f"{topic_prefix}-bp", store=store, brokers=KAFKA, topic_prefix=topic_prefix, page_size=5,
              max_in_flight=40)
    seen: list[logstore.Cell] = []

    @app.trigger("BASE")
    async def slow(cell: logstore.Cell) -> None:
        seen.append(cell)
        await asyncio.sleep(0.0005)

    calls: list[tuple[str, tuple[str, int]]] = []

    def counted(name: str) -> Any:
        call = getattr(GroupConsumer, name)

        def counting(self: GroupConsumer, tp: tuple[str, int]) -> None:
            calls.append((name, tp))
            call(self, tp)
        return counting

    for name in ("pause", "resume"):
        monkeypatch.setattr(GroupConsumer, name, counted(name))
    with app:
        counts = app.drain(timeout=90)
    assert counts.processed == len(cells) and counts.dead_lettered == 0
    assert sorted(c.added_id for c in seen) == sorted(c.added_id for c in cells)  # each once
    assert {tp[1] for name, tp in calls if name == "pause"} == {tp[1] for name, tp in calls if name == "resume"} \
        == set(range(P))
    order: dict[int, list[int]] = defaultdict(list)
    for cell in seen:
        order[cell.shard].append(cell.added_id)
    assert all(ids == sorted(ids) for ids in order.values())


@pytest.mark.parametrize("fetch_wait", [0.1, 0.0])
def test_records_trickling_in_reach_the_app_a_handful_at_once_while_they_wait_for_the_fetch(
        store: logstore.Store, topic_prefix: str, fetch_wait: float) -> None:
    """With fetch_wait the broker holds a fetch until 64 KiB of records or fetch_wait: 40 records sent one every
    10 ms reach a batch handler several at once (one wake-up of the loop for each handful), and a lone record is
    not held for the 64 KiB. With fetch_wait 0 each fetch answers at its first record."""
    from tailer.messages import encode_cell

    write(store, 1)
    publish(store, topic_prefix)  # makes the topic, and a first record to wait for
    cells = write(store, 40)
    app = App(f"{topic_prefix}-trickle", store=store, brokers=KAFKA, topic_prefix=topic_prefix, fetch_wait=fetch_wait)
    batches: list[int] = []

    @app.batch_trigger("BASE")
    async def handle(got: list[logstore.Cell]) -> None:
        batches.append(len(got))

    async def trickle() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=KAFKA, acks=1)
        await producer.start()
        try:
            for cell in cells:
                key, value, headers = encode_cell(cell)
                await producer.send_and_wait(f"{topic_prefix}.BASE", value, key=key, partition=0, headers=headers)
                await asyncio.sleep(0.01)
        finally:
            await producer.stop()

    with app, app_in_thread(app, "trickle-app") as running:
        deadline = time.monotonic() + 60
        while not batches:
            assert time.monotonic() < deadline and not running.failed, running.failed
            time.sleep(0.01)
        asyncio.run(trickle())
        while sum(batches) < 41:
            assert time.monotonic() < deadline and not running.failed, running.failed
            time.sleep(0.01)
    later = batches[1:]
    if fetch_wait:
        assert sum(later) / len(later) >= 3, later
    else:
        assert sum(later) / len(later) < 3, later
