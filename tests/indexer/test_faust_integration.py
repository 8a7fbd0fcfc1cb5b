"""A team's own faust app on cellstream's topics (indexer.faust), against the real Kafka of `make test`: the
tailer publishes cells (JSON and MessagePack), a faust agent receives each as a logstore.Cell, and the one it
cannot process is dead-lettered the cellstream way: an entry in the store that `cellstream dlq` lists, mirrored
to the <app>.dlq topic (read back with kcat)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import faust
import pytest

import logstore
from indexer.faust import DeadLetters, register_codec
from indexer.runtime.dlq_store import DeadLetterStore
from tests.harness.kafka_support import kcat_read, publish
from tests.harness.shared_servers import KAFKA

SHARDS = 8


@pytest.mark.parametrize("value_format", ["json", "msgpack"])
def test_a_faust_agent_gets_cells_and_dead_letters_the_cellstream_way(
        sqlite_url: str, tmp_path: Path, topic_prefix: str, value_format: str) -> None:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n, "poison": n == 7}) for n in range(20)])
        publish(store, topic_prefix, value_format=value_format)
        name = f"{topic_prefix}-faust"
        register_codec()
        got: list[logstore.Cell] = []

        async def run() -> None:
            app = faust.App(name, broker=f"kafka://{KAFKA}", web_enabled=False, datadir=str(tmp_path / "faust"),
                            autodiscover=False, topic_disable_leader=True, consumer_auto_offset_reset="earliest")
            topic = app.topic(f"{topic_prefix}.BASE", value_serializer="cellstream", key_serializer="raw")
            dead = DeadLetters(name, store, KAFKA)

            async def agent(stream: Any) -> None:
                async for event in stream.events():
                    cell = event.value
                    try:
                        if cell.body["poison"]:
                            raise ValueError(f"cannot bill ride {cell.body['n']}")
                        got.append(cell)
                    except ValueError as exc:
                        await dead.deadletter("bill", event, exc)

            app.agent(topic, name=f"{name}.bill")(agent)
            await app.start()
            try:
                async with asyncio.timeout(60):
                    while len(got) < len(cells) - 1 or not DeadLetterStore(store, name).entries():
                        await asyncio.sleep(0.1)
            finally:
                await app.stop()
                await dead.close()

        asyncio.run(run())
        poison = next(c for c in cells if c.body["poison"])
        assert sorted(got, key=lambda c: c.added_id) == sorted((c for c in cells if c is not poison),
                                                                key=lambda c: c.added_id)
        [entry] = DeadLetterStore(store, name).entries()
        assert (entry.handler, entry.column, entry.body, entry.status) == ("bill", "BASE", poison.body, "open")
        assert entry.cell["added_id"] == poison.added_id and entry.source["mode"] == "faust"
        assert "cannot bill ride 7" in entry.message and "ValueError" in entry.traceback
    mirrored = kcat_read(KAFKA, f"{name}.dlq")
    assert [m.value["id"] for m in mirrored] == [entry.id] and mirrored[0].headers["handler"] == "bill"
