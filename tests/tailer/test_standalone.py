"""The tailer in standalone mode (offsets in a file, topics as files): the embedded default, no servers.

The same worker runs in Kafka mode (tests/tailer/test_kafka.py); these tests pin
what does not depend on Kafka: message shape, order, resume, dead letters.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import pytest

import logstore
from cellstream.cli.main import main
from tailer.config import TailerConfig
from tailer.coordinators.local import LocalCoordinator, read_offsets
from tailer.publishers.directory import DirectoryPublisher, read_topic
from tailer.worker import Tailer
from tests.harness.stores import sqlite_file

SHARDS = 8


def put_many(store: logstore.Store, n: int, column: str = "BASE") -> list[logstore.Cell]:
    return store.put_cells([(uuid.uuid4(), column, 1, {"i": i, "pad": "x" * (i % 50)}) for i in range(n)])


def topic_cells(root: Path, topic: str) -> list[tuple[int, dict[str, Any]]]:
    return list(read_topic(root, topic))


async def run_until(tailer: Tailer, done: Any, timeout: float = 30.0) -> None:
    async with tailer:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the tailer did not publish in time"
            await asyncio.sleep(0.02)


def make(store: logstore.Store, tmp_path: Path, **options: Any) -> Tailer:
    max_bytes = options.pop("max_bytes", 100_000)
    config = TailerConfig(name="t", partitions=options.pop("partitions", 4), **options)
    return Tailer(store, config, LocalCoordinator(tmp_path / "offsets.json", store.shard_count),
                  DirectoryPublisher(tmp_path / "topics", max_message_bytes=max_bytes))


def assert_per_shard_order(messages: list[tuple[int, dict[str, Any]]], partitions: int) -> dict[int, list[int]]:
    by_shard: dict[int, list[int]] = {}
    for partition, record in messages:
        value = record["value"]
        assert partition == value["shard"] % partitions
        by_shard.setdefault(value["shard"], []).append(value["added_id"])
    for ids in by_shard.values():
        assert ids == sorted(ids)
    return by_shard


@pytest.fixture
def store(sqlite_url: str) -> Any:
    with logstore.open(sqlite_url, shards=SHARDS) as s:
        yield s


def test_every_cell_is_published_once_in_shard_order_with_the_documented_message(
    store: logstore.Store, tmp_path: Path
) -> None:
    cells = put_many(store, 500)
    root = tmp_path / "topics"
    asyncio.run(run_until(make(store, tmp_path), lambda: len(topic_cells(root, "cells.BASE")) >= 500))
    messages = topic_cells(root, "cells.BASE")
    by_shard = assert_per_shard_order(messages, 4)
    assert sorted(i for ids in by_shard.values() for i in ids) == sorted(c.added_id for c in cells)
    first = next(c for c in cells if c.added_id == messages[0][1]["value"]["added_id"])
    record = messages[0][1]
    assert record["key"] == str(first.row_key)
    assert record["headers"] == {"shard": str(first.shard), "added_id": str(first.added_id), "column": "BASE",
                                 "ref_key": "1", "created_at": first.created_at.isoformat(),
                                 "content-type": "application/json"}
    assert record["value"] == first.to_json()
    offsets = read_offsets(tmp_path / "offsets.json")
    for shard in range(SHARDS):
        assert offsets.get(str(shard), {}).get("location", 0) == store.head(shard)


def test_a_restart_resumes_from_the_committed_offsets_without_loss_or_repeats(
    store: logstore.Store, tmp_path: Path
) -> None:
    root = tmp_path / "topics"
    put_many(store, 200)
    asyncio.run(run_until(make(store, tmp_path), lambda: len(topic_cells(root, "cells.BASE")) >= 200))
    put_many(store, 300)
    asyncio.run(run_until(make(store, tmp_path), lambda: len(topic_cells(root, "cells.BASE")) >= 500))
    time.sleep(0.2)
    by_shard = assert_per_shard_order(topic_cells(root, "cells.BASE"), 4)
    ids = [i for v in by_shard.values() for i in v]
    assert len(ids) == len(set(ids)) == 500


def test_columns_and_start_now_select_what_is_published(store: logstore.Store, tmp_path: Path) -> None:
    root = tmp_path / "topics"
    put_many(store, 50, "BASE")
    tailer = make(store, tmp_path, columns=("FARE",), start_from="now")

    async def scenario() -> None:
        async with tailer:
            while len(tailer.owned) < SHARDS:
                await asyncio.sleep(0.01)
            fares = put_many(store, 40, "FARE")
            put_many(store, 40, "BASE")
            deadline = time.monotonic() + 20
            while len(topic_cells(root, "cells.FARE")) < len(fares):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
    asyncio.run(scenario())
    assert len(topic_cells(root, "cells.FARE")) == 40
    assert not (root / "cells.BASE").exists()


def test_reserved_columns_are_published_only_when_named(store: logstore.Store, tmp_path: Path) -> None:
    """Cells of ``_`` columns (dead-letter entries with bodies and tracebacks, catalogs) are cellstream's own:
    without ``columns`` the tailer passes over them, acknowledged in order, so every shard's offset still
    reaches its head; named, they are published like any column."""
    root = tmp_path / "topics"
    base = []
    for i in range(6):  # runs of plain and reserved cells, interleaved in every shard
        base += put_many(store, 20)
        store.put_system_cells([(uuid.uuid4(), "_secret", 1, {"token": i}) for _ in range(15)])
    asyncio.run(run_until(make(store, tmp_path), lambda: all(
        read_offsets(tmp_path / "offsets.json").get(str(s), {}).get("location", 0) == store.head(s)
        for s in range(SHARDS))))
    assert sorted(r["value"]["added_id"] for _, r in topic_cells(root, "cells.BASE")) == sorted(
        c.added_id for c in base)
    assert sorted(p.name for p in root.iterdir()) == ["cells-deadletter", "cells.BASE"]

    named = tmp_path / "named"
    named.mkdir()
    asyncio.run(run_until(make(store, named, columns=("BASE", "_secret")),
                          lambda: len(topic_cells(named / "topics", "cells._secret")) >= 90))
    assert len(topic_cells(named / "topics", "cells.BASE")) == 120


def test_start_from_a_time_skips_only_older_cells(store: logstore.Store, tmp_path: Path) -> None:
    root = tmp_path / "topics"
    put_many(store, 30)
    time.sleep(0.01)
    since = dt.datetime.now(dt.UTC)
    newer = put_many(store, 30)
    asyncio.run(run_until(make(store, tmp_path, start_from=since),
                          lambda: len(topic_cells(root, "cells.BASE")) >= 30))
    time.sleep(0.2)
    got = sorted(r["value"]["added_id"] for _, r in topic_cells(root, "cells.BASE"))
    assert got == sorted(c.added_id for c in newer)


def test_an_undecodable_cell_is_dead_lettered_by_name_and_the_shard_goes_on(
    store: logstore.Store, sqlite_url: str, tmp_path: Path
) -> None:
    import sqlite3

    key = uuid.uuid4()
    cells = [store.put_cell(key, "BASE", ref, {"ref": ref}) for ref in range(1, 6)]
    with sqlite3.connect(sqlite_file(sqlite_url)) as conn:
        conn.execute("UPDATE cells SET body = x'7f00' WHERE added_id = ?", (cells[2].added_id,))
    root = tmp_path / "topics"
    asyncio.run(run_until(make(store, tmp_path), lambda: len(topic_cells(root, "cells.BASE")) >= 4
                          and len(topic_cells(root, "cells-deadletter")) >= 1))
    assert [r["value"]["ref_key"] for _, r in topic_cells(root, "cells.BASE")] == [1, 2, 4, 5]
    [(partition, dead)] = topic_cells(root, "cells-deadletter")
    assert partition == cells[2].shard % 4
    assert dead["value"]["cell"]["added_id"] == cells[2].added_id
    assert dead["value"]["cell"]["row_key"] == str(key) and dead["value"]["cell"]["ref_key"] == 3
    assert dead["value"]["stage"] == "decode" and dead["value"]["error"]["type"] == "CorruptCellError"
    assert dead["headers"]["error"] == "CorruptCellError"
    offset = read_offsets(tmp_path / "offsets.json")[str(cells[0].shard)]
    assert offset["location"] == cells[-1].added_id and offset["deadlettered"] == 1
    assert offset["last_error"]["added_id"] == cells[2].added_id


def test_a_message_over_the_size_limit_is_dead_lettered_and_the_rest_published(
    store: logstore.Store, tmp_path: Path
) -> None:
    key = uuid.uuid4()
    small = store.put_cell(key, "BASE", 1, {"n": 1})
    big = store.put_cell(key, "BASE", 2, {"blob": os.urandom(60_000).hex()})
    after = store.put_cell(key, "BASE", 3, {"n": 3})
    root = tmp_path / "topics"
    tailer = make(store, tmp_path, max_bytes=50_000)
    asyncio.run(run_until(tailer, lambda: len(topic_cells(root, "cells.BASE")) >= 2
                          and len(topic_cells(root, "cells-deadletter")) >= 1))
    assert [r["value"]["added_id"] for _, r in topic_cells(root, "cells.BASE")] == [small.added_id, after.added_id]
    [(_, dead)] = topic_cells(root, "cells-deadletter")
    assert dead["value"]["cell"]["added_id"] == big.added_id and dead["value"]["stage"] == "publish"
    assert "over the 50000-byte limit" in dead["value"]["error"]["message"]


def test_msgpack_values_carry_the_stored_body_never_decoded(
    store: logstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --format msgpack the stored MessagePack of a body is the message's, decompressed only: the
    value is byte for byte what packing the decoded cell gives, and no body is decoded on the way."""
    import base64

    import msgpack

    from tailer.messages import decode_cell

    cells = put_many(store, 50)
    cells.append(store.put_cell(uuid.uuid4(), "BASE", 1, {"deep": {"list": [1, 2.5, None, "✓"]}, "big": 2**64 - 1}))
    root = tmp_path / "topics"

    def decoded(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a body was decoded")

    with monkeypatch.context() as patched:
        patched.setattr(msgpack, "unpackb", decoded)
        asyncio.run(run_until(make(store, tmp_path, value_format="msgpack"),
                              lambda: len(topic_cells(root, "cells.BASE")) >= 51))
    messages = topic_cells(root, "cells.BASE")
    assert len(messages) == 51
    for _, record in messages:
        raw = base64.b64decode(record["value"])
        assert record["headers"]["content-type"] == "application/msgpack"
        cell = decode_cell(raw, [(k, v.encode()) for k, v in record["headers"].items()])
        assert cell in cells
        assert raw == msgpack.packb({**cell.to_json(), "body": cell.body}, use_bin_type=True)


def test_a_second_standalone_process_on_the_same_offsets_is_refused(store: logstore.Store, tmp_path: Path) -> None:
    first = LocalCoordinator(tmp_path / "offsets.json", SHARDS)
    first.start(lambda: None)
    try:
        with pytest.raises(Exception, match="another tailer process"):
            LocalCoordinator(tmp_path / "offsets.json", SHARDS).start(lambda: None)
    finally:
        first.stop()


def test_cli_tail_stops_gracefully_on_sigterm_and_status_reports_it(
    store: logstore.Store, sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put_many(store, 120)
    args = ["tail", "--store", sqlite_url, "--name", "cli", "--out", str(tmp_path / "topics"),
            "--offsets", str(tmp_path / "offsets.json"), "--partitions", "4"]
    proc = subprocess.Popen([sys.executable, "-m", "cellstream", *args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(topic_cells(tmp_path / "topics", "cells.BASE")) < 120:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    offsets = read_offsets(tmp_path / "offsets.json")
    assert sum(1 for doc in offsets.values() if doc["location"]) == len({c for c in range(SHARDS)
                                                                       if store.head(c)})
    put_many(store, 7)
    assert main(["tail", "status", "cli", "--store", sqlite_url, "--offsets", str(tmp_path / "offsets.json"),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sum(r["lag_cells"] for r in report["shards"]) == 7
    assert all(r["location"] == r["head"] for r in report["shards"] if not r["lag_cells"])


def test_cli_tail_refuses_bad_options_with_one_line(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    logstore.open(sqlite_url, shards=SHARDS).close()  # the store exists: the options are what is wrong
    assert main(["tail", "--store", sqlite_url, "--name", "x", "--out", "d"]) == 2
    assert "--zookeeper" in capsys.readouterr().err
    assert main(["tail", "--store", sqlite_url, "--name", "bad name!", "--out", "d", "--offsets", "f"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad name!" in err
    assert main(["tail", "--store", sqlite_url, "--name", "x", "--out", "d", "--offsets", "f",
                 "--from", "yesterday"]) == 2
    assert "--from" in capsys.readouterr().err


def test_busy_shards_take_turns_so_none_waits_for_another_to_be_drained(
    store: logstore.Store, tmp_path: Path
) -> None:
    cells = put_many(store, 400)  # about 50 a shard, ten pages each
    busy = {c.shard for c in cells}
    root = tmp_path / "topics"
    tailer = make(store, tmp_path, partitions=1, page_size=5, read_ahead=1)
    asyncio.run(run_until(tailer, lambda: len(topic_cells(root, "cells.BASE")) >= 400))
    first_pages = [record["value"]["shard"] for _, record in topic_cells(root, "cells.BASE")[: 5 * len(busy)]]
    assert set(first_pages) == busy  # one page of every shard before a second page of any


@pytest.mark.parametrize(("read_ahead", "most"), [(None, 1), (3, 3)])
def test_reads_of_the_embedded_store_run_one_at_a_time_unless_configured(
    store: logstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_ahead: int | None, most: int
) -> None:
    """Concurrent SQLite reads queue for the GIL (twice the CPU of serial reads), so by default the worker
    reads an embedded store one query at a time (Store.parallel_reads); ``read_ahead`` overrides it. The lag
    monitor's one-cell reads (tailer/lag.py, through get_cells_for_shards, every few seconds) are not the
    worker's reads and are not counted: they made this test fail now and then."""
    put_many(store, 400)
    assert store.parallel_reads == 1
    under_way, seen, lock, lag = [0], [0], threading.Lock(), threading.local()
    read, read_cells = store.read_pages, store.get_cells_for_shards

    def lag_read(*args: Any, **kwargs: Any) -> Any:
        lag.reading = True
        try:
            return read_cells(*args, **kwargs)
        finally:
            lag.reading = False

    def slow_read(*args: Any, **kwargs: Any) -> Any:
        if getattr(lag, "reading", False):
            return read(*args, **kwargs)
        with lock:
            under_way[0] += 1
            seen[0] = max(seen[0], under_way[0])
        try:
            time.sleep(0.02)  # long enough for the loop to launch every read it may
            return read(*args, **kwargs)
        finally:
            with lock:
                under_way[0] -= 1

    monkeypatch.setattr(store, "read_pages", slow_read)
    monkeypatch.setattr(store, "get_cells_for_shards", lag_read)
    root = tmp_path / "topics"
    tailer = make(store, tmp_path, partitions=1, page_size=5, read_ahead=read_ahead)
    asyncio.run(run_until(tailer, lambda: len(topic_cells(root, "cells.BASE")) >= 400))
    assert seen[0] == most


@pytest.mark.parametrize("value_format", ["json", "msgpack"])
def test_a_message_value_is_the_whole_record_serialized(
    store: logstore.Store, value_format: Literal["json", "msgpack"]
) -> None:
    """encode_cell writes the fields around the body itself: the bytes must be those of serializing the
    record whole, for every body (escapes, non-ASCII, numbers at the limits, nesting) and both cell kinds."""
    import msgpack
    from pydantic_core import to_json

    from tailer.messages import encode_cell

    bodies = [{}, {"q": 'quote " backslash \\ newline \n tab \t nul \x00'}, {"ü": "✓ 漢字 🚕"},
              {"big": 2**64 - 1, "small": -(2**63), "f": 1e-300, "g": 1.5e300, "z": -0.0},
              {"deep": [[[{"a": [None, True, False]}]]]}, {"x": "x" * 3000}]
    for cell in store.put_cells([(uuid.uuid4(), "BASE_2", ref, body) for ref, body in enumerate(bodies)]):
        record = {**cell.to_json()}
        whole = to_json(record) if value_format == "json" else msgpack.packb(record, use_bin_type=True)
        assert encode_cell(cell, value_format).value == whole
        [packed] = store.get_packed_cells_for_shards({cell.shard: cell.added_id - 1}, 1)[cell.shard]  # type: ignore[misc]
        assert encode_cell(packed, value_format).value == whole


@pytest.mark.parametrize("value_format", ["json", "msgpack"])
def test_a_message_carries_its_own_cells_time_when_times_repeat(value_format: Literal["json", "msgpack"],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_cell reuses the texts of the UTC times it rendered (a transaction's cells share one), and keeps
    a bounded number of them: each message still names its cell's time, the same instant in another zone
    with that zone's offset."""
    from tailer import messages
    from tailer.messages import decode_cell, encode_cell

    monkeypatch.setattr(messages, "_RENDERED_KEPT", 2)
    monkeypatch.setattr(messages, "_rendered", {})

    utc = dt.datetime(2026, 11, 25, 9, 30, 0, 250_000, tzinfo=dt.UTC)
    times = [utc, utc.replace(), utc.astimezone(dt.timezone(dt.timedelta(hours=1))), utc,
             utc + dt.timedelta(microseconds=1), utc.replace(microsecond=0), utc.replace(microsecond=0)]
    for added_id, when in enumerate(times, 1):
        cell = logstore.Cell(uuid.uuid4(), "BASE", 1, {"n": added_id}, added_id, 3, when)
        message = encode_cell(cell, value_format)
        assert dict(message.headers)["created_at"] == when.isoformat().encode()
        decoded = decode_cell(message.value, message.headers)
        assert decoded.created_at == when and decoded.created_at.utcoffset() == when.utcoffset()
    assert 1 <= len(messages._rendered) <= 2


def test_a_json_body_the_fast_encoder_cannot_write_exactly_is_decided_by_the_careful_one() -> None:
    """orjson writes NaN and Infinity as null and refuses integers over 64 bits: a body holding them is still
    refused (NaN, Infinity, next to a real null too) or written as the whole record's serialization."""
    from pydantic_core import to_json

    from tailer.messages import encode_cell

    def cell(body: dict[str, Any]) -> logstore.Cell:  # built directly: the store refuses such bodies
        return logstore.Cell(uuid.uuid4(), "BASE", 1, body, 1, 3, dt.datetime(2026, 11, 25, tzinfo=dt.UTC))

    for bad in ({"x": float("nan")}, {"x": [None, float("inf")]}, {"n": None, "x": -float("inf")}):
        with pytest.raises(ValueError, match="not JSON compliant"):
            encode_cell(cell(bad))
    for good in ({"x": "NaN", "y": "Infinity", "z": None}, {"big": 2**64, "n": None}, {"k": "null"}):
        c = cell(good)
        assert encode_cell(c).value == to_json({**c.to_json()})


def test_cellstream_tail_tunes_its_process_for_streaming(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tail command owns its process: it raises the collector's thresholds before its loop runs (the
    default ones cost the tailer 10-15% of its throughput), freezes what start-up allocated, so that a
    full collection does not walk every module's objects (pauses of 20-60 ms at 1,000 cells/s), and
    shortens the switch interval so that its loop gets the GIL back sooner from the reader threads."""
    import gc

    import cellstream.cli.tail as tail_command
    from cellstream.cli.common import STREAMING_GC_THRESHOLDS, STREAMING_SWITCH_INTERVAL

    seen: list[tuple[int, int, int]] = []
    frozen: list[int] = []
    intervals: list[float] = []

    def run(main: Any) -> int:
        main.close()  # the tailer's loop is not the point here
        seen.append(gc.get_threshold())
        frozen.append(gc.get_freeze_count())
        intervals.append(sys.getswitchinterval())
        return 0

    logstore.open(sqlite_url, shards=SHARDS).close()
    gc.set_threshold(700, 10, 10)  # Python's defaults (tests/conftest.py restores the suite's after each test)
    sys.setswitchinterval(0.005)
    monkeypatch.setattr(tail_command.asyncio, "run", run)
    assert main(["tail", "--store", sqlite_url, "--name", "gc", "--out", str(tmp_path / "topics"),
                 "--offsets", str(tmp_path / "offsets.json")]) == 0
    assert seen == [STREAMING_GC_THRESHOLDS] != [(700, 10, 10)]
    assert frozen[0] > 10_000  # the imported modules' objects at least
    assert intervals == [STREAMING_SWITCH_INTERVAL] != [0.005]


@pytest.mark.parametrize("value_format", ["json", "msgpack"])
def test_the_worker_decodes_its_pages_on_its_loop_not_in_the_read_threads(
    store: logstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value_format: str
) -> None:
    """Reads hand the loop undecoded pages (Store.read_pages), so that a read thread beside the busy loop does
    not wait for the GIL back after each body's zlib call. Pages of busy shards and those a count poll brings
    of idle shards alike; cells written after the first ones were published come by a count poll."""
    from logstore.backends.sqlite import recorder

    decoded_in: list[threading.Thread] = []
    decode_pages = recorder.decode_pages

    def spy(*args: Any) -> Any:
        decoded_in.append(threading.current_thread())
        return decode_pages(*args)

    monkeypatch.setattr(recorder, "decode_pages", spy)
    put_many(store, 20)
    root = tmp_path / "topics"
    tailer = make(store, tmp_path, partitions=1, page_size=5, value_format=value_format)
    later: list[logstore.Cell] = []

    def done() -> bool:
        published = len(topic_cells(root, "cells.BASE"))
        if published >= 20 and not later:
            later.extend(put_many(store, 20))
        return published >= 40

    asyncio.run(run_until(tailer, done))
    assert decoded_in and set(decoded_in) == {threading.main_thread()}


def test_a_failed_write_of_one_partition_is_sent_again_and_nothing_else_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk fails the fsync of one partition's file once, in the middle of reads of many shards each:
    that file is cut back and its shards send their cells again; the other partitions' shards, read in the
    same deliveries, are not sent again. Every cell is in its topic once, in its shard's order."""
    import errno

    from tailer.publishers import directory

    real_fsync = directory.os.fsync
    failures: list[str] = []

    def full_disk_once(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("partition-1.jsonl") and os.path.getsize(path) > 0 and not failures:
            failures.append(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(directory.os, "fsync", full_disk_once)
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=64) as store:
        put_many(store, 3000)
        root = tmp_path / "topics"
        tailer = make(store, tmp_path, page_size=100)  # a read holds a few cells of each of many shards
        asyncio.run(run_until(tailer, lambda: len(topic_cells(root, "cells.BASE")) >= 3000))
        time.sleep(0.2)
    assert failures
    messages = topic_cells(root, "cells.BASE")
    by_shard = assert_per_shard_order(messages, 4)
    ids = [(shard, i) for shard, added in by_shard.items() for i in added]
    assert len(ids) == len(set(ids)) == 3000


def test_after_a_failed_write_a_partition_takes_nothing_until_the_failure_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Kafka's idempotent producer refuses a partition's later batches: a message sent after the failed ones
    must not be written before they are sent again. Other partitions go on."""
    import errno

    from tailer.errors import PublishError
    from tailer.messages import Message
    from tailer.publishers import directory

    real_fsync = directory.os.fsync

    def full_disk(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("partition-1.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    def message(n: int) -> Message:
        return Message(b"k", json.dumps({"n": n}).encode(), [])

    async def run() -> None:
        publisher = DirectoryPublisher(tmp_path / "topics", linger=0.001)
        async with publisher:
            await publisher.prepare_topic("t", 2, 1)
            monkeypatch.setattr(directory.os, "fsync", full_disk)
            [(failed, _)] = await publisher.send_many("t", 1, [message(1)])
            with pytest.raises(PublishError) as raised:
                await failed
            assert raised.value.retriable and "No space left" in str(raised.value)
            monkeypatch.setattr(directory.os, "fsync", real_fsync)
            [(later, _)] = await publisher.send_many("t", 1, [message(2)])
            [(other, _)] = await publisher.send_many("t", 0, [message(3)])
            assert await other == 0
            with pytest.raises(PublishError):
                await later  # refused: message 1 has not been sent again yet
            await publisher.after_failure(raised.value, failed)
            [(again, _)] = await publisher.send_many("t", 1, [message(1)])
            assert await again == 0  # the failed write was cut back: the file starts with it

    asyncio.run(run())
    assert [(p, r["value"]["n"]) for p, r in read_topic(tmp_path / "topics", "t")] == [(0, 3), (1, 1)]


def test_a_page_cut_short_by_the_read_budget_is_not_taken_for_the_end_of_the_log(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A read's byte budget (StoreOptions.max_read_bytes) cuts pages short of page_size: the worker reads on
    after such a page instead of marking the shard drained, which had left the rest unpublished until the
    shard's next write."""
    with logstore.open(sqlite_url, shards=SHARDS, max_read_bytes=8_000) as store:
        row = uuid.uuid4()  # one row: every cell in one shard
        store.put_cells([(row, "BASE", i, {"i": i, "pad": "x" * 2_000}) for i in range(1, 61)])
        root = tmp_path / "topics"
        tailer = make(store, tmp_path, partitions=1, page_size=50)
        asyncio.run(run_until(tailer, lambda: len(topic_cells(root, "cells.BASE")) >= 60, timeout=20))
        published = [record["value"]["ref_key"] for _, record in topic_cells(root, "cells.BASE")]
        assert published == list(range(1, 61))
