"""``cellstream demo``: the pipeline on the embedded default, no server needed.

Each capability adds its part here: the logstore (trips written as cells, read
back, immutability and typed errors, a shard log paged), the tailer (every
shard published to topics, offsets committed after acks, resume, dead letters) and
the stream-processing runtime (a trigger, a poison cell dead-lettered and replayed)
and secondary indexes (kept by an app, backfilled, activated, queried, rebuilt).
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
import uuid
from typing import TextIO

import logstore
from cellstream.demo.app import app_demo
from cellstream.demo.index import index_demo
from cellstream.demo.tailer import tailer_demo
from logstore.extras import missing

DEMO_SHARDS = 16
CITIES = ["Aarhus", "Lisbon", "Oakland", "Sao Paulo", "Hyderabad"]


def run_demo(store_url: str | None, out: TextIO) -> int:
    if store_url is None:
        with tempfile.TemporaryDirectory(prefix="cellstream-demo-") as tmp:
            return _demo(f"sqlite:///{tmp}/store", out, shards=DEMO_SHARDS)
    return _demo(store_url, out, shards=None)


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out, flush=True)


def _has_extra(out: TextIO, extra: str, section: str) -> bool:
    module = missing(extra)
    if module is not None:
        _say(out, f"\n== {section}: skipped, it needs cellstream[{extra}] ({module} is not installed): "
                  f"pip install 'cellstream[{extra}]'")
    return module is None


def _demo(url: str, out: TextIO, shards: int | None) -> int:
    with logstore.open(url, shards=shards) as store:
        _say(out, f"== logstore: {store!r}")
        _say(out, f"   {store.shard_count} shards; a shard is hash(row_key) mod {store.shard_count}, "
                  "every shard is a log ordered by added_id")

        _say(out, "\n== 1. write trips: a BASE cell each, STATUS versions by ref_key")
        trips = [uuid.UUID(int=(0x5EED << 112) | i) for i in range(1, 13)]
        base = store.put_cells([
            (trip, "BASE", 1, {"city": CITIES[i % len(CITIES)], "driver": f"driver-{i % 4}", "rider": f"rider-{i % 5}",
                               "fare": round(9.5 + i * 1.25, 2), "trip_created_at": f"2026-11-21T10:{i:02d}:00Z"})
            for i, trip in enumerate(trips)
        ])
        store.put_cells([(trip, "STATUS", 1, {"is_completed": False}) for trip in trips])
        paid = store.put_cells([(trip, "STATUS", 2, {"is_completed": True, "charged": c.body["fare"]})
                                for trip, c in zip(trips[::2], base[::2], strict=True)])
        _say(out, f"   wrote {len(base)} BASE, {len(trips)} STATUS@1 and {len(paid)} STATUS@2 cells")

        trip = trips[0]
        _say(out, f"\n== 2. read back trip {trip}")
        latest = store.get_cell_latest(trip, "STATUS")
        assert latest is not None
        _say(out, f"   get_cell_latest(STATUS) -> ref_key {latest.ref_key}: {json.dumps(latest.body)}")
        first = store.get_cell(trip, "STATUS", 1)
        assert first is not None
        _say(out, f"   get_cell(STATUS, 1)     -> {json.dumps(first.body)} (old versions stay)")
        row = store.get_row(trip)
        _say(out, "   get_row                 -> " + ", ".join(f"{c}@{cell.ref_key}" for c, cell in row.items()))

        _say(out, "\n== 3. cells are immutable")
        again = store.put_cell(trip, "BASE", 1, dict(base[0].body))
        _say(out, f"   same body again: no-op, same cell (added_id {again.added_id} == {base[0].added_id})")
        try:
            store.put_cell(trip, "BASE", 1, {**base[0].body, "fare": 0})
        except logstore.CellConflictError as exc:
            _say(out, f"   different body: CellConflictError: {exc}")
        for bad in ({"fare": float("nan")}, {"city": {"name": ("tuple",)}}):
            try:
                store.put_cell(trip, "NOTES", 1, bad)
            except logstore.InvalidCellError as exc:
                _say(out, f"   bad input: InvalidCellError: {exc}")
        try:
            store.put_cell(trip, "_offsets", 1, {})
        except logstore.InvalidCellError as exc:
            _say(out, f"   reserved column: InvalidCellError: {exc}")

        shard = base[0].shard
        _say(out, f"\n== 4. tail shard {shard}'s log, 3 cells a page, as a tailer would")
        location, page_no = 0, 0
        while True:
            cells, location = store.get_cells_for_shard(shard, location, limit=3)
            if not cells:
                break
            page_no += 1
            for cell in cells:
                _say(out, f"   page {page_no}: added_id={cell.added_id} {cell.column}@{cell.ref_key} "
                          f"row={str(cell.row_key)[-12:]} {json.dumps(cell.body)}")
            _say(out, f"   page {page_no}: next location {location}")
        _say(out, f"   caught up at location {location} (head {store.head(shard)})")
        later = store.put_cell(trip, "NOTES", 1, {"text": "rider left an umbrella"})
        cells, location = store.get_cells_for_shard(shard, location)
        _say(out, f"   a new cell arrives: {[(c.added_id, c.column) for c in cells]} (written as {later.added_id})")
        since = store.location_at(shard, later.created_at - dt.timedelta(microseconds=1))
        _say(out, f"   location_at({later.created_at.isoformat()}) -> {since}: tailing from a time")

        busy = sorted((s for s in store.shard_stats() if s.cells), key=lambda s: -s.cells)
        _say(out, f"\n== 5. {sum(s.cells for s in busy)} cells in {len(busy)} of {store.shard_count} shards; "
                  "busiest: " + ", ".join(f"shard {s.shard}={s.cells}" for s in busy[:4]))
        tailer_demo(store, out)
        app_demo(store, out, blocked="rider-3")
        index_demo(store, out, trips[1])
        # The lake and the worker node need extras; without one the section says so and the rest runs.
        if _has_extra(out, "parquet", "10. a warehouse connector into a Parquet lake"):
            from cellstream.demo.connect import connect_demo

            connect_demo(store, out)
        if _has_extra(out, "server", "11. a worker node: the logstore API over HTTP"):
            from cellstream.demo.worker import worker_demo

            worker_demo(store, out, trips[0])
    _say(out, "\ndemo finished")
    return 0
