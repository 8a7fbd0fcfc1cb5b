"""A worker node's answers of the logs, against stored data made to hurt it (issue 49, findings 4 and 6).

Each log answer holds to its store's byte budget (StoreOptions.max_read_bytes): a page cut short pages on from
its last cell, and a client reading through the node gets every cell. A stored body that does not decode to
JSON is a CorruptCellError of its cell alone: before, it made the whole shard's answer a 500, every time, so
every reader of that shard was stuck."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

import logstore
from logstore.backends.http.recorder import HttpRecorder
from logstore.backends.http.target import HttpTarget
from logstore.config import parse_node_url
from logstore.persistence import ReadBudget, TruncatedPage
from tailer.config import TailerConfig
from tailer.coordinators.local import LocalCoordinator
from tailer.publishers.directory import DirectoryPublisher, read_topic
from tailer.worker import Tailer
from tests.harness.stores import keys_in_shard, sqlite_file
from tests.harness.worker_support import NodeThread, call

SHARDS = 4
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def served(sqlite_url: str) -> Iterator[tuple[logstore.Store, NodeThread]]:
    """A store with a small read budget (300 KB) behind a worker node."""
    with logstore.open(sqlite_url, shards=SHARDS, max_read_bytes=300_000) as store:
        node = NodeThread(store).start()
        try:
            yield store, node
        finally:
            node.stop()


def _packed_size(doc: dict[str, Any]) -> int:
    return len(msgpack.packb(doc["body"]))


def test_compressible_bodies_no_longer_make_an_answer_of_hundreds_of_megabytes(sqlite_url: str) -> None:
    """The review's attack at the default budget (16 MiB): 30 bodies of 4 MiB that compress to a few KB each.
    One answer held all 30 (120 MiB of bodies, over 2 GB of memory for 8 such reads at once)."""
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        budget, most = store.options.max_read_bytes, store.options.max_body_bytes
        [key] = keys_in_shard(store, 1, 1)
        for ref in range(30):
            store.put_cell(key, "BASE", ref, {"s": chr(97 + ref % 26) * (most - 64)})
        node = NodeThread(store).start()
        try:
            after, refs, answers = 0, [], 0
            while True:
                status, answer, _ = call(node.url, "GET", f"/v1/shards/1/log?after={after}&limit=1000")
                assert status == 200
                if not answer["cells"]:
                    break
                answers += 1
                assert sum(map(_packed_size, answer["cells"])) <= budget + most
                refs += [c["ref_key"] for c in answer["cells"]]
                assert answer["next"] == answer["cells"][-1]["added_id"]
                after = answer["next"]
            assert refs == list(range(30)) and answers >= 30 * most // (budget + most)
            status, answer, _ = call(node.url, "POST", "/v1/logs", json.dumps({"locations": {"1": 0, "2": 0}}).encode(),
                                     JSON)
            assert status == 200 and answer["pages"]["2"]["cells"] == []
            assert 1 <= len(answer["pages"]["1"]["cells"]) <= budget // most + 1
        finally:
            node.stop()


def test_a_client_reads_every_cell_in_order_through_a_node_that_cuts_its_answers(
    served: tuple[logstore.Store, NodeThread]
) -> None:
    store, node = served
    written: dict[int, list[logstore.Cell]] = {}
    for shard in (0, 3):
        keys = keys_in_shard(store, shard, 25)
        written[shard] = store.put_cells([(key, "BASE", 1, {"i": i, "pad": "y" * (30_000 + 997 * i)})
                                          for i, key in enumerate(keys)])
    with logstore.open(node.url) as client:
        for shard in (0, 3):  # a page at a time, on from each page's last cell
            got, location, pages = [], 0, 0
            while True:
                page, location = client.get_cells_for_shard(shard, location, 1000)
                if not page:
                    break
                assert sum(len(msgpack.packb(c.body)) for c in page) < 300_000 + 60_000
                got.extend(page)
                pages += 1
            assert got == written[shard] and pages >= 3
        many: dict[int, list[logstore.Cell]] = {0: [], 3: []}
        locations = {0: 0, 3: 0}
        while locations:  # many shards a read, each read on after its last cell until its page is empty
            for shard, page in client.get_cells_for_shards(locations, 1000).items():
                assert isinstance(page, list)
                many[shard].extend(page)
                locations[shard] = page[-1].added_id if page else -1
            locations = {s: at for s, at in locations.items() if at >= 0}
        assert many == written


@pytest.mark.parametrize("packed", [False, True])
def test_a_page_the_node_says_it_cut_short_is_a_truncated_page_for_the_client(
    served: tuple[logstore.Store, NodeThread], monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    store, node = served
    cells = store.put_cells([(key, "BASE", 1, {"i": i}) for i, key in enumerate(keys_in_shard(store, 2, 3))])
    docs = [c.to_json() for c in cells]
    answer = {"pages": {"2": {"cells": docs[:2], "truncated": True}, "3": {"cells": docs[2:]}, "1": {"cells": []}}}
    target = parse_node_url(node.url)
    assert isinstance(target, HttpTarget)
    recorder = HttpRecorder("node0", target, store.options)
    monkeypatch.setattr(recorder, "_request", lambda *args, **kwargs: answer)
    pages = recorder.read_logs([(1, 0), (2, 0), (3, 0)], 1000, None, packed, ReadBudget(1))()
    assert isinstance(pages[2], TruncatedPage) and [c.to_cell() if packed else c for c in pages[2]] == cells[:2]
    assert type(pages[3]) is list and type(pages[1]) is list and not pages[1]


def _poison() -> bytes:
    return b"\x01" + zlib.compress(msgpack.packb({"a": b"\x00\xff", "b": float("nan")}, use_bin_type=True))


def test_a_body_that_is_not_json_spoils_its_own_cell_and_not_the_answer(
    served: tuple[logstore.Store, NodeThread], sqlite_url: str
) -> None:
    store, node = served
    [key] = keys_in_shard(store, 2, 1)
    cells = [store.put_cell(key, "BASE", ref, {"ref": ref}) for ref in range(1, 5)]
    [other] = keys_in_shard(store, 3, 1)
    beside = store.put_cell(other, "BASE", 1, {"ok": True})
    with sqlite3.connect(sqlite_file(sqlite_url)) as conn:
        conn.execute("UPDATE cells SET body = ? WHERE added_id = ?", (_poison(), cells[1].added_id))

    status, answer, _ = call(node.url, "GET", "/v1/shards/2/log")
    assert status == 500 and answer["error"]["type"] == "CorruptCellError"
    assert answer["error"]["coordinates"]["added_id"] == cells[1].added_id
    assert [c["ref_key"] for c in answer["error"]["cells_before"]] == [1]
    status, answer, _ = call(node.url, "POST", "/v1/logs", json.dumps({"locations": {"2": 0, "3": 0}}).encode(), JSON)
    assert status == 200 and answer["pages"]["3"]["cells"] == [beside.to_json()]
    assert answer["pages"]["2"]["error"]["type"] == "CorruptCellError"
    status, answer, _ = call(node.url, "GET", f"/v1/shards/2/log?after={cells[1].added_id}")
    assert status == 200 and [c["ref_key"] for c in answer["cells"]] == [3, 4]


def test_a_tailer_reading_through_the_node_dead_letters_the_poisoned_cell_and_goes_on(
    served: tuple[logstore.Store, NodeThread], sqlite_url: str, tmp_path: Path
) -> None:
    store, node = served
    [key] = keys_in_shard(store, 1, 1)
    cells = [store.put_cell(key, "BASE", ref, {"ref": ref}) for ref in range(1, 6)]
    with sqlite3.connect(sqlite_file(sqlite_url)) as conn:
        conn.execute("UPDATE cells SET body = ? WHERE added_id = ?", (_poison(), cells[2].added_id))
    root = tmp_path / "topics"

    def published(topic: str) -> list[dict[str, Any]]:
        return [record["value"] for _, record in read_topic(root, topic)]

    async def run(client: logstore.Store) -> None:
        config = TailerConfig(name="t", partitions=2)
        tailer = Tailer(client, config, LocalCoordinator(tmp_path / "offsets.json", SHARDS),
                        DirectoryPublisher(root, max_message_bytes=100_000))
        async with tailer:
            deadline = time.monotonic() + 30
            while len(published("cells.BASE")) < 4 or not published("cells-deadletter"):
                assert time.monotonic() < deadline, "the shard is stuck behind its poisoned cell"
                await asyncio.sleep(0.05)

    with logstore.open(node.url) as client:
        asyncio.run(run(client))
    assert [m["ref_key"] for m in published("cells.BASE")] == [1, 2, 4, 5]
    [dead] = published("cells-deadletter")
    assert dead["cell"]["added_id"] == cells[2].added_id and dead["error"]["type"] == "CorruptCellError"
