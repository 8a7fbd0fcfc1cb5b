"""The backup as a job of :mod:`logstore.jobs` (kind ``backup``): pausable, throttled (``rate`` in cells a
second), resumable by ``cellstream jobs resume ID --run`` after its process dies.

Steps: ``start`` (the plan and state file, :func:`~logstore.backup.create.start_backup`; run again, it finds the
plan), one ``cells FIRST-LAST`` step per cell file (a file written before is kept; its manifest entry is the
step's cursor), and ``finish`` (the manifest, of the entries the steps recorded, or each file read back to
describe it when one is missing). The backup's id is chosen when the job is submitted, so every step, in any
process, works on the same backup. Unthrottled, a step reads the next file's blocks while it writes its own
(:class:`~logstore.backup.create.ReadAhead`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from logstore.backup.create import (
    ReadAhead,
    chunk_shards_for,
    file_ranges,
    finish_backup,
    start_backup,
    write_cell_file,
)
from logstore.backup.manifest import MANIFEST, BackupFile, Plan, new_backup_id, read_plan
from logstore.backup.storage import open_storage
from logstore.errors import BackupError, InvalidArgumentError
from logstore.jobs import JobKind, JobRecord, StepContext, StepRecord
from logstore.store import Store

KIND = "backup"


def job_params(store: Store, dest: str, *, incremental: bool, chunk_shards: int | None = None) -> dict[str, Any]:
    """The parameters of a backup job of ``store`` to ``dest`` (a directory or ``s3://``, credentials never in
    it), with a new backup id; ``chunk_shards`` None sizes the cell files to about
    :data:`~logstore.backup.create.CELLS_A_FILE` cells.

    Raises:
        InvalidArgumentError: ``chunk_shards`` below 1, or a destination that does not open.
    """
    if chunk_shards is not None and chunk_shards < 1:
        raise InvalidArgumentError(f"chunk_shards must be at least 1, got {chunk_shards}")
    storage = open_storage(dest)  # refuses credentials in the URL now, not in the job's first step
    if chunk_shards is None:  # the steps are planned now: the files' ranges too
        chunk_shards = chunk_shards_for(store, storage, incremental)
    return {"dest": dest, "backup_id": new_backup_id(dt.datetime.now(dt.UTC)), "incremental": incremental,
            "chunk_shards": chunk_shards, "shard_count": store.shard_count}


class BackupJob(JobKind):
    """A backup of the store the runner works on; params as :func:`job_params` makes them."""

    name = KIND
    unit = "cells"

    def __init__(self, store: Store) -> None:
        self.store = store
        self._ahead: ReadAhead | None = None

    def plan(self, params: dict[str, Any]) -> list[StepRecord]:
        shard_count, size = int(params["shard_count"]), int(params["chunk_shards"])
        ranges = [(first, min(first + size, shard_count) - 1) for first in range(0, shard_count, size)]
        return [StepRecord(name="start"),
                *(StepRecord(name=f"cells {a}-{b}", params={"first": a, "last": b}) for a, b in ranges),
                StepRecord(name="finish")]

    def run_step(self, step: StepRecord, context: StepContext) -> None:
        params = context.job.params
        storage = open_storage(params["dest"])
        if step.name == "start":
            plan = start_backup(self.store, storage, incremental=bool(params["incremental"]),
                                chunk_shards=int(params["chunk_shards"]), backup_id=params["backup_id"])
            if plan.shard_count != self.store.shard_count:
                raise BackupError(f"backup {plan.backup_id} is of {plan.shard_count} shards, the store has "
                                  f"{self.store.shard_count}")
            context.progress(0, 0)
            return
        plan = read_plan(storage, params["backup_id"])
        if step.name == "finish":
            if storage.exists(f"{plan.backup_id}/{MANIFEST}"):
                # Finished already: the job's record may be a copy, restored from a backup taken while it ran
                # (job records are cells too), and resumed there. A backup's objects are never rewritten.
                context.progress(0, 0)
                return
            if self._ahead is not None:
                self._ahead.close()
                self._ahead = None
            manifest = finish_backup(storage, plan, _recorded_files(context.job.steps, plan))
            context.progress(manifest.cells, manifest.cells)
            return
        first, last = int(step.params["first"]), int(step.params["last"])
        # At most: ids are dense but for burnt ones (and the progress bar needs no query per file).
        total = sum(plan.watermarks[s] - plan.bases[s] for s in range(first, last + 1))
        done = 0

        def pace(cells: int) -> None:
            nonlocal done
            done += cells
            context.progress(done, total)
            context.throttle.wait(cells)
        settings = context.throttle.settings
        if settings.rate is None and not settings.nice_ratio and not settings.pause_seconds:
            self._ahead = self._ahead or ReadAhead(self.store)
        elif self._ahead is not None:  # throttled since: every read waits its turn
            self._ahead.close()
            self._ahead = None
        entry = write_cell_file(self.store, storage, plan, first, last, pace, self._ahead)
        context.progress(entry.cells, entry.cells, cursor={"file": entry.model_dump(mode="json")})

    def describe(self, record: JobRecord) -> str:
        kind = "incremental backup" if record.params.get("incremental") else "backup"
        return f"{kind} {record.params.get('backup_id')} to {record.params.get('dest')}"


def _recorded_files(steps: list[StepRecord], plan: Plan) -> list[BackupFile] | None:
    """The manifest entries the cells steps recorded, in order, or None when one is missing (the finish then
    reads each file back)."""
    entries = [BackupFile.model_validate(s.cursor["file"]) for s in steps
               if s.name.startswith("cells ") and isinstance(s.cursor, dict) and "file" in s.cursor]
    return entries if len(entries) == len(file_ranges(plan)) else None
