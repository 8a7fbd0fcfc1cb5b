"""A real little job kind for the job tests: copies the cells of column ``src`` of some shards into column
``dst``, one step per shard, in chunks.

Each copied cell gets the next number of its step as its ref_key (``dst`` ref_keys 1, 2, 3... per shard), so a
chunk copied twice shows as two ``dst`` cells of one row: the tests count them. With ``own_cursor`` the kind
writes its cursor as a cell in the same ``put_cells`` as the chunk (one transaction: the shard's node is one
database), and reads it back when a step starts (Vitess's copy state); without, it trusts the runner's cursor.

Run as a module, it is a runner process: ``python -m tests.logstore.copy_job STORE_URL JOB_ID LEASE_SECONDS``.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import logstore
from logstore import StorageUnavailableError, Store
from logstore.cell import shard_of
from logstore.errors import StorageError
from logstore.jobs import JobKind, JobRunner, KindRegistry, RunnerConfig, StepContext, StepRecord

CURSOR_COLUMN = "copycursor"


def key_in_shard(base: str, shard: int, shard_count: int) -> uuid.UUID:
    n = 0
    while True:
        key = uuid.uuid5(uuid.NAMESPACE_URL, f"{base}/{n}")
        if shard_of(key, shard_count) == shard:
            return key
        n += 1


class CopyKind(JobKind):
    """Params: ``shards`` (list), ``chunk`` (cells a chunk), ``own_cursor`` (bool), ``fail`` (optional:
    ``{"times": N, "retriable": bool}``, the first N runs of every step raise)."""

    name = "copy"
    unit = "cells"

    def __init__(self, store: Store) -> None:
        self.store = store
        self.copied = 0  # cells this instance copied (in this process)
        self.runs = 0  # runs of run_step

    def plan(self, params: dict[str, Any]) -> list[StepRecord]:
        return [StepRecord(name=f"shard {shard}", params={"shard": shard}) for shard in params["shards"]]

    def run_step(self, step: StepRecord, context: StepContext) -> None:
        self.runs += 1
        params = context.job.params
        fail = params.get("fail")
        if fail and self.runs <= fail["times"]:
            raise (StorageUnavailableError if fail["retriable"] else StorageError)(f"copy run {self.runs} failed")
        shard, chunk = step.params["shard"], params.get("chunk", 10)
        cursor_key = key_in_shard(f"{context.job.id}/{step.name}", shard, self.store.shard_count)
        cursor: dict[str, int] = {"location": 0, "seq": 0, "n": 0}
        if params.get("own_cursor", True):
            found = self.store.get_cell_latest(cursor_key, CURSOR_COLUMN)
            if found is not None:
                cursor = dict(found.body)
        elif context.cursor is not None:
            cursor = dict(context.cursor)
        total = self.store.count_after(shard, 0, columns=["src"])
        while True:
            page, location = self.store.get_cells_for_shard(shard, cursor["location"], chunk, columns=["src"])
            if not page:
                break
            cells: list[tuple[uuid.UUID | str, str, int, dict[str, Any]]] = [
                (c.row_key, "dst", cursor["seq"] + i + 1, {"from": c.ref_key, **c.body}) for i, c in enumerate(page)]
            cursor = {"location": location, "seq": cursor["seq"] + len(page), "n": cursor["n"] + 1}
            if params.get("own_cursor", True):
                cells.append((cursor_key, CURSOR_COLUMN, cursor["n"], cursor))
            self.store.put_cells(cells)
            self.copied += len(page)
            context.progress(cursor["seq"], total, cursor=cursor)
            context.throttle.wait(len(page))


def main(url: str, job_id: str, lease: float) -> None:
    with logstore.open(url) as store:
        kinds = KindRegistry([CopyKind(store)])
        config = RunnerConfig(lease_seconds=lease, poll_seconds=0.1, progress_seconds=0.0)
        JobRunner(store, kinds, config).run(job_id)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
