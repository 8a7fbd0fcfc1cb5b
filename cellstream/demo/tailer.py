"""The tailer's part of the demo: standalone mode (offsets in a file, topics as files), no servers.

The same worker publishes to Kafka with `cellstream tail --brokers ... --zookeeper ...`.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import TextIO

import logstore
from tailer.config import TailerConfig
from tailer.coordinators.local import LocalCoordinator, read_offsets
from tailer.publishers.directory import DirectoryPublisher, read_topic
from tailer.worker import Tailer

PARTITIONS = 4


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out, flush=True)


async def _run_until_caught_up(store: logstore.Store, root: Path, timeout: float = 30.0) -> Tailer:
    config = TailerConfig(name="demo", partitions=PARTITIONS, poll_interval=0.01)
    tailer = Tailer(store, config, LocalCoordinator(root / "offsets.json", store.shard_count),
                    DirectoryPublisher(root / "topics", max_message_bytes=20_000))
    heads = {info.shard: store.head(info.shard) for info in store.shard_stats() if info.cells}
    async with tailer:
        deadline = time.monotonic() + timeout
        while len(tailer.owned) < store.shard_count or any(
                positions[s][1] < head for positions in [tailer.positions()] for s, head in heads.items()):
            if time.monotonic() > deadline:
                raise RuntimeError("the demo tailer did not catch up")
            await asyncio.sleep(0.02)
    return tailer


def tailer_demo(store: logstore.Store, out: TextIO) -> None:
    with tempfile.TemporaryDirectory(prefix="cellstream-tail-") as tmp:
        root = Path(tmp)
        _say(out, "\n== 6. tail every shard to topics (standalone: offsets in a file, topics as files)")
        asyncio.run(_run_until_caught_up(store, root))
        topics = Counter(topic for topic in (p.name for p in (root / "topics").iterdir()))
        counts = {t: sum(1 for _ in read_topic(root / "topics", t)) for t in sorted(topics)}
        _say(out, "   published: " + ", ".join(f"{t}={n}" for t, n in counts.items()))
        partition, first = next(read_topic(root / "topics", "cells.BASE"))
        _say(out, f"   a message on cells.BASE partition {partition} (= shard {first['value']['shard']} mod "
                  f"{PARTITIONS}): key {first['key']}")
        _say(out, f"     headers {json.dumps(first['headers'])}")
        _say(out, f"     value   {json.dumps(first['value'])}")
        offsets = read_offsets(root / "offsets.json")
        _say(out, f"   committed offsets after the acks: {len(offsets)} shards, e.g. shard {next(iter(offsets))} at "
                  f"location {next(iter(offsets.values()))['location']}")

        _say(out, "\n== 7. stop, write more (one cell too large to publish), start again: it resumes")
        trip = uuid.UUID(int=(0x5EED << 112) | 99)
        store.put_cell(trip, "BASE", 1, {"city": "Aarhus", "rider": "rider-1", "fare": 12.5})
        big = store.put_cell(trip, "NOTES", 1, {"text": "x" * 30_000})
        store.put_cell(trip, "STATUS", 1, {"is_completed": True})
        before = sum(counts.values())
        asyncio.run(_run_until_caught_up(store, root))
        after = sum(sum(1 for _ in read_topic(root / "topics", t.name)) for t in (root / "topics").iterdir()
                    if t.name != "cells-deadletter")
        _say(out, f"   {after - before} new messages published, none repeated (offsets resumed)")
        [(_, dead)] = list(read_topic(root / "topics", "cells-deadletter"))
        _say(out, f"   dead-lettered added_id {dead['value']['cell']['added_id']} (the {len(big.body['text'])}-char "
                  f"note): {dead['value']['error']['message']}")
        _say(out, f"   shard {big.shard} offset counts it: deadlettered="
                  f"{read_offsets(root / 'offsets.json')[str(big.shard)]['deadlettered']}; nothing skipped silently")
