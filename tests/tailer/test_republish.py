"""Re-publishing a range to a tailer's topics while it goes on tailing (tailer/republish.py): against the real
MariaDB, ZooKeeper and Kafka of `make test`, the topics read back by kcat; a SIGKILL of a `cellstream tail`
process in the middle of a re-publish; and, without servers, the standalone tailer's hand-back on a graceful
stop, the status and the command's refusals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from logstore.jobs import JobRecord, JobStore
from tailer.config import KafkaOptions, TailerConfig
from tailer.coordinators.local import LocalCoordinator
from tailer.coordinators.zookeeper import ZooKeeperCoordinator
from tailer.errors import PublishError
from tailer.messages import Message
from tailer.publishers.directory import DirectoryPublisher, read_topic
from tailer.publishers.kafka import KafkaPublisher
from tailer.republish import HEADER
from tailer.worker import Tailer
from tests.harness import REPO
from tests.harness.kafka_support import Msg, kcat_read
from tests.harness.shared_servers import KAFKA

SHARDS = 16
P = 4


class Writer:
    """Puts cells of BASE and STATUS from a thread until stopped, as the live traffic; remembers them."""

    def __init__(self, store: logstore.Store, rate: float = 200.0) -> None:
        self.store, self.rate = store, rate
        self.cells: list[logstore.Cell] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.cells.extend(self.store.put_cells(
                [(uuid.uuid4(), column, 1, {"live": True}) for column in ("BASE", "STATUS") for _ in range(3)]))
            time.sleep(6 / self.rate)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def put(store: logstore.Store, n: int) -> list[logstore.Cell]:
    return store.put_cells([(uuid.uuid4(), column, 1, {"i": i}) for i in range(n) for column in ("BASE", "STATUS")])


def ids(cells: Any) -> set[tuple[int, int]]:
    return {(c.shard, c.added_id) for c in cells}


def republished(messages: list[Msg], job_id: str) -> list[tuple[int, int]]:
    return [(int(m.headers["shard"]), int(m.headers["added_id"])) for m in messages if m.headers.get(HEADER) == job_id]


def watermarks(record: JobRecord) -> dict[int, tuple[int, int]]:
    """shard -> (after, up_to) of the job's range, as its steps hold them."""
    return {s: (a, u) for step in record.steps
            for s, a, u in zip(step.params["shards"], step.params["after"], step.params["until"], strict=True)}


def in_range(cells: Any, ranges: dict[int, tuple[int, int]], column: str) -> set[tuple[int, int]]:
    return {(c.shard, c.added_id) for c in cells if c.column == column and c.shard in ranges
            and ranges[c.shard][0] < c.added_id <= ranges[c.shard][1]}


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def read_until(topic: str, check: Callable[[list[Msg]], bool], timeout: float = 90.0) -> list[Msg]:
    """kcat reads the topic until ``check`` holds of its messages."""
    deadline = time.monotonic() + timeout
    while True:
        messages = kcat_read(KAFKA, topic)
        if check(messages):
            return messages
        assert time.monotonic() < deadline, f"{topic} never got what was expected ({len(messages)} messages)"
        time.sleep(0.5)


@pytest.fixture
def store(mysql_database: str) -> Iterator[logstore.Store]:
    with logstore.open(mysql_database, shards=SHARDS) as s:
        yield s


def test_a_republish_while_tailing_delivers_every_cell_of_the_range_and_only_those_and_the_live_stream_goes_on(
    store: logstore.Store, mysql_database: str, zk_chroot: str, topic_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "again"
    before = put(store, 150)  # before the range's start time
    time.sleep(0.05)
    inside = put(store, 150)
    start = min(c.created_at for c in inside)
    config = TailerConfig(name=name, topic_prefix=topic_prefix, partitions=P, session_timeout=6)
    tailer = Tailer(store, config, ZooKeeperCoordinator(zk_chroot, name, SHARDS, session_timeout=6),
                    KafkaPublisher(KafkaOptions(brokers=KAFKA)), republish=True)
    base, status_topic = f"{topic_prefix}.BASE", f"{topic_prefix}.STATUS"

    async def scenario() -> JobRecord:
        async with tailer:
            with Writer(store) as writer:
                await asyncio.sleep(1)
                assert await asyncio.to_thread(main, [
                    "tail", "republish", name, "--store", mysql_database, "--columns", "BASE", "--shards", "0-11",
                    "--from", start.isoformat(), "--rate", "400", "--json"]) == 0
                job_id = json.loads(capsys.readouterr().out)["id"]
                jobs = JobStore(store)
                while (record := await asyncio.to_thread(jobs.get, job_id)).state != "done":
                    assert record.state in ("planned", "running"), record
                    await asyncio.sleep(0.3)
                await asyncio.sleep(1)  # the live stream goes on after the job
                writer.stop()
                live = list(writer.cells)
                await asyncio.to_thread(read_until, base, lambda ms: ids(c for c in before + inside + live
                                                                          if c.column == "BASE")
                                        <= {(int(m.headers["shard"]), int(m.headers["added_id"])) for m in ms})
                assert await asyncio.to_thread(main, ["tail", "status", name, "--store", mysql_database,
                                                      "--zookeeper", zk_chroot, "--json"]) == 0
                return record

    record = asyncio.run(scenario())
    report = json.loads(capsys.readouterr().out)
    ranges = watermarks(record)
    assert set(ranges) <= set(range(12))
    # The range is the cells of BASE in shards 0-11 created at or after the start, up to each shard's head when
    # the job was requested: nothing of before, everything of inside, and the live cells up to the watermark.
    expected = in_range(store_cells(store, ranges), ranges, "BASE")
    assert ids(c for c in inside if c.column == "BASE" and c.shard < 12) <= expected
    assert not expected & ids(before)
    messages = kcat_read(KAFKA, base)
    again = republished(messages, record.id)
    assert set(again) == expected
    assert len(again) == len(set(again))  # no failure in this run: each once
    assert record.done == len(expected)
    # Live messages never carry the header, and every cell written was published live (the stream went on).
    live_ids = [(int(m.headers["shard"]), int(m.headers["added_id"])) for m in messages if HEADER not in m.headers]
    assert ids(c for c in store_cells(store, None) if c.column == "BASE") <= set(live_ids)
    # Same message format as the live ones: the same value for a cell, published twice.
    by_cell: dict[tuple[str, str], list[Msg]] = {}
    for m in messages:
        by_cell.setdefault((m.headers["shard"], m.headers["added_id"]), []).append(m)
    some = next(ms for ms in by_cell.values() if len(ms) == 2)
    assert some[0].value == some[1].value and some[0].key == some[1].key and some[0].partition == some[1].partition
    assert not any(HEADER in m.headers for m in kcat_read(KAFKA, status_topic))  # another column: untouched
    jobs = report["republish"]
    assert [(j["id"], j["state"], j["done"], j["columns"], j["shards"]) for j in jobs] == [
        (record.id, "done", record.done, ["BASE"], "0-11")]


def store_cells(store: logstore.Store, ranges: dict[int, tuple[int, int]] | None) -> list[logstore.Cell]:
    """Every cell of the store's shards (those of ``ranges``), read back."""
    out: list[logstore.Cell] = []
    for shard in (ranges or range(store.shard_count)):
        location = 0
        while True:
            page, location = store.get_cells_for_shard(shard, location, 1000)
            out.extend(page)
            if len(page) < 1000:
                break
    return out


class TailProcess:
    """One `cellstream tail` process of the tailer ``name``."""

    def __init__(self, tmp: Path, store_url: str, zk: str, prefix: str, name: str) -> None:
        self.log = tmp / f"tail-{uuid.uuid4().hex[:6]}.log"
        args = [sys.executable, "-m", "cellstream", "tail", "--store", store_url, "--brokers", KAFKA,
                "--zookeeper", zk, "--name", name, "--prefix", prefix, "--partitions", str(P),
                "--session-timeout", "5"]
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(REPO)})

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.poll()


@pytest.fixture
def processes() -> Iterator[list[TailProcess]]:
    started: list[TailProcess] = []
    yield started
    for p in started:
        p.stop()


def test_sigkill_of_the_tailer_mid_republish_then_a_restart_completes_the_range(
    store: logstore.Store, mysql_database: str, zk_chroot: str, topic_prefix: str, tmp_path: Path,
    processes: list[TailProcess], capsys: pytest.CaptureFixture[str],
) -> None:
    name = "killed"
    written = put(store, 2500)
    base = f"{topic_prefix}.BASE"
    with Writer(store, rate=100) as writer:
        processes.append(TailProcess(tmp_path, mysql_database, zk_chroot, topic_prefix, name))
        assert main(["tail", "republish", name, "--store", mysql_database, "--rate", "300", "--json"]) == 0
        job_id = json.loads(capsys.readouterr().out)["id"]
        jobs = JobStore(store)
        # Killed once the job has recorded some of its progress, well before its end, and has published more
        # since (its progress is recorded every 5 s): the next runner sends that part again.
        record = wait_until(lambda: (r := jobs.get(job_id)) and r.done >= 1000 and r, 90, "recorded progress")
        assert record.state == "running" and record.total is not None and record.done < record.total - 2000
        time.sleep(2)
        victim = processes[0]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        processes.append(TailProcess(tmp_path, mysql_database, zk_chroot, topic_prefix, name))
        record = wait_until(lambda: (r := jobs.get(job_id)) and r.state == "done" and r, 120, "the job's end")
        assert record.owner is None
        writer.stop()
    ranges = watermarks(record)
    expected_base = in_range(written + writer.cells, ranges, "BASE")
    expected_status = in_range(written + writer.cells, ranges, "STATUS")
    expected = expected_base | expected_status
    assert len(expected) >= 5000
    base_messages = read_until(base, lambda ms: expected_base <= set(republished(ms, job_id)))
    status_messages = read_until(f"{topic_prefix}.STATUS",
                                 lambda ms: expected_status <= set(republished(ms, job_id)))
    again = republished(base_messages, job_id) + republished(status_messages, job_id)
    assert set(again) == expected  # at least once, nothing outside the range
    repeated = Counter(again)
    assert max(repeated.values()) <= 2 and sum(1 for n in repeated.values() if n == 2) > 0
    # The restarted tailer took the job over from the dead one (its lease's owner, a pid of this host, is gone).
    assert f"job {job_id}: taking over from" in processes[1].log.read_text()
    assert processes[1].stop() == 0


# -- without servers: the standalone tailer -------------------------------------------------------------------
def standalone(store: logstore.Store, tmp: Path, columns: tuple[str, ...] | None = None) -> Tailer:
    config = TailerConfig(name="solo", partitions=2, columns=columns)
    return Tailer(store, config, LocalCoordinator(tmp / "offsets.json", store.shard_count),
                  DirectoryPublisher(tmp / "out"), republish=True)


def test_a_graceful_stop_hands_the_job_back_and_the_next_tailer_goes_on_from_its_cursor(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with logstore.open(sqlite_url, shards=8) as store:
        written = put(store, 400)
        # 50 cells/s: 8 s of work, so the first tailer, stopped 1.5 s after it is seen running, is mid-job even
        # where it was seen late (at 150 cells/s a slow CI machine saw it done).
        assert main(["tail", "republish", "solo", "--store", sqlite_url, "--columns", "BASE", "--rate", "50",
                     "--json"]) == 0
        job_id = json.loads(capsys.readouterr().out)["id"]
        jobs = JobStore(store)

        async def first() -> None:
            async with standalone(store, tmp_path):
                deadline = time.monotonic() + 30
                while jobs.get(job_id).state != "running":
                    assert time.monotonic() < deadline, "the tailer did not take the job"
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.5)
        asyncio.run(first())
        handed = jobs.get(job_id)
        assert handed.state == "running" and handed.owner is None  # claimable at once, its place recorded
        assert 0 < handed.done < 400 and handed.steps[0].cursor["done"] == handed.done
        assert main(["tail", "status", "solo", "--store", sqlite_url, "--offsets", str(tmp_path / "offsets.json"),
                     "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)["republish"]
        assert [(j["id"], j["state"], j["done"]) for j in shown] == [(job_id, "running", handed.done)]

        async def second() -> None:
            async with standalone(store, tmp_path):
                deadline = time.monotonic() + 30
                while jobs.get(job_id).state != "done":
                    assert time.monotonic() < deadline, "the second tailer did not finish the job"
                    await asyncio.sleep(0.1)
        asyncio.run(second())
        messages = [m for _, m in read_topic(tmp_path / "out", "cells.BASE")]
        again = [(int(m["headers"]["shard"]), int(m["headers"]["added_id"])) for m in messages
                 if m["headers"].get(HEADER) == job_id]
        assert set(again) == ids(c for c in written if c.column == "BASE")
        # Handed back at its acknowledged place: the second tailer went on from there, sending nothing twice.
        assert len(again) == len(set(again))
        assert main(["tail", "status", "solo", "--store", sqlite_url, "--offsets",
                     str(tmp_path / "offsets.json")]) == 0
        assert f"republish {job_id}: done 400/400 cells (400 published, 0 skipped) columns=BASE" in \
            capsys.readouterr().out


def test_a_column_the_tailer_does_not_publish_fails_the_job_with_the_reason(sqlite_url: str, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    with logstore.open(sqlite_url, shards=4) as store:
        put(store, 10)
        assert main(["tail", "republish", "solo", "--store", sqlite_url, "--columns", "STATUS", "--json"]) == 0
        job_id = json.loads(capsys.readouterr().out)["id"]

        async def run() -> JobRecord:
            async with standalone(store, tmp_path, columns=("BASE",)):
                deadline = time.monotonic() + 30
                while (record := JobStore(store).get(job_id)).state not in ("failed", "done"):
                    assert time.monotonic() < deadline, "the job did not end"
                    await asyncio.sleep(0.1)
                return record
        record = asyncio.run(run())
        assert record.state == "failed"
        assert record.error is not None and "does not publish column 'STATUS'" in record.error


@pytest.mark.parametrize(("argv", "says"), [
    (["--shards", "0-99"], "out of range"),
    (["--from", "yesterday"], "is not beginning, end"),
    (["--columns", "no-such"], "is not a column name"),
    (["--rate", "0"], "--rate must be above 0"),
    (["--columns", "_dlq"], "is cellstream's own"),
    (["--columns", "NOPE"], "NOPE has no cell in the range"),
    (["--from", "2026-11-27T21:00:00Z", "--until", "2026-11-27T20:00:00Z"], "is before --from"),
    (["--from", "1:40", "--until", "1:30"], "--until 1:30 is before --from 1:40"),
])
def test_republish_refuses_bad_input_in_one_line(sqlite_url: str, argv: list[str], says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(sqlite_url, shards=4) as store:
        put(store, 10)
    assert main(["tail", "republish", "solo", "--store", sqlite_url, *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


class FlakyDirectory(DirectoryPublisher):
    """The standalone publisher, but the first ``failures`` deliveries of re-published messages to partition 1
    fail (retriable), as a broker's refusals do: the other partition's are acknowledged."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(root)
        self.failures = failures

    async def send_many(self, topic: str, partition: int, messages: Sequence[Message]
                        ) -> list[tuple[asyncio.Future[Any], int]]:
        if partition == 1 and self.failures > 0 and any(name == HEADER for m in messages for name, _ in m.headers):
            self.failures -= 1
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(PublishError("refused for the test", retriable=True))
            return [(failed, len(messages))]
        return await super().send_many(topic, partition, messages)


def test_a_shard_moves_on_only_over_acknowledged_cells_so_failed_deliveries_are_sent_again(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with logstore.open(sqlite_url, shards=8) as store:
        written = put(store, 300)
        publisher = FlakyDirectory(tmp_path / "out", failures=6)
        tailer = Tailer(store, TailerConfig(name="solo", partitions=2),
                        LocalCoordinator(tmp_path / "offsets.json", store.shard_count), publisher, republish=True)
        assert main(["tail", "republish", "solo", "--store", sqlite_url, "--rate", "200", "--json"]) == 0
        job_id = json.loads(capsys.readouterr().out)["id"]

        async def run() -> JobRecord:
            async with tailer:
                deadline = time.monotonic() + 60
                while (record := JobStore(store).get(job_id)).state not in ("done", "failed"):
                    assert time.monotonic() < deadline, "the job did not end"
                    await asyncio.sleep(0.1)
                return record
        record = asyncio.run(run())
    assert record.state == "done" and publisher.failures == 0
    again = {(int(m["headers"]["shard"]), int(m["headers"]["added_id"])) for column in ("BASE", "STATUS")
             for _, m in read_topic(tmp_path / "out", f"cells.{column}") if m["headers"].get(HEADER) == job_id}
    assert again == ids(written)
    assert record.done == len(written) and record.steps[0].cursor["skipped"] == 0


def test_a_cell_too_large_for_the_topic_is_skipped_and_counted_and_the_rest_published(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with logstore.open(sqlite_url, shards=4) as store:
        written = put(store, 20)
        big = store.put_cell(uuid.uuid4(), "BASE", 1, {"blob": "x" * 5000})
        written += put(store, 20)
        tailer = Tailer(store, TailerConfig(name="solo", partitions=2),
                        LocalCoordinator(tmp_path / "offsets.json", store.shard_count),
                        DirectoryPublisher(tmp_path / "out", max_message_bytes=2000), republish=True)
        assert main(["tail", "republish", "solo", "--store", sqlite_url, "--json"]) == 0
        job_id = json.loads(capsys.readouterr().out)["id"]

        async def run() -> JobRecord:
            async with tailer:
                deadline = time.monotonic() + 30
                while (record := JobStore(store).get(job_id)).state not in ("done", "failed"):
                    assert time.monotonic() < deadline, "the job did not end"
                    await asyncio.sleep(0.1)
                return record
        record = asyncio.run(run())
    assert record.state == "done"
    assert (record.done, sum(s.cursor["skipped"] for s in record.steps)) == (len(written) + 1, 1)
    again = {(int(m["headers"]["shard"]), int(m["headers"]["added_id"])) for column in ("BASE", "STATUS")
             for _, m in read_topic(tmp_path / "out", f"cells.{column}") if m["headers"].get(HEADER) == job_id}
    assert again == ids(written) and (big.shard, big.added_id) not in again
