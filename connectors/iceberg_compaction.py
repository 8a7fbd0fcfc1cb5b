"""Compaction and snapshot expiry of a connector's Apache Iceberg tables: the ``compact`` job's steps when the
connector's sink is ``type: iceberg`` (:class:`connectors.compaction.LakeCompaction` dispatches here).

Steps, as Iceberg's ``rewrite_data_files`` and ``expire_snapshots`` / ``remove_orphan_files`` actions do them:

1. One step per (table, closed day partition) holding more than one *small* data file (under three quarters of
   ``target_bytes`` on disk, Iceberg's ``min-file-size-bytes``; closed: its day is before ``before``). The step
   reads those files with pyiceberg's Arrow reader against the table's current schema (a file written before a
   column was added reads it as nulls), sorts the rows by (shard, added_id), writes files of about
   ``target_bytes`` with pyiceberg's writer and commits ONE snapshot that deletes exactly those files and adds
   the new ones (an ``overwrite`` of named files, never one by filter): a reader's scan plans from one snapshot,
   so it sees the old files or the new ones, never both nor neither. The snapshot carries the newest
   ``cellstream.connector``, ``cellstream.offsets`` and ``cellstream.source`` forward, so a restarted connector
   reads its positions from it. A connector appending meanwhile makes the commit fail (the catalog swaps the
   metadata pointer only if the branch head is the one the step started from): the step reloads the table and,
   when all its input files are still live, commits the same new files on the new head (the appended files stay,
   untouched); when one is gone (another compaction), it deletes its files and plans the partition again.
2. A last step expires, in every table, the snapshots older than ``expire_older_than`` seconds but the current
   one and, for each connector, the newest carrying its offsets (pyiceberg's
   ``table.maintenance.expire_snapshots()``); then deletes the files only expired snapshots referenced (data
   files, manifests, manifest lists) and the *orphans*: files under the table's location that neither the
   metadata nor any snapshot references (a writer killed between writing files and committing them, metadata
   files past ``write.metadata.previous-versions-max``), once older than ``orphan_age`` seconds (a day), so a
   commit in flight keeps its files.

A step killed half-way leaves at most files no snapshot references (removed as orphans a day later); run again,
it plans from the table as it is then, so a job resumed after its runner died goes on from the first step not
done. Catalog and file errors are SinkUnavailableError (retriable: the runner runs the step again).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files, schema_to_pyarrow
from pyiceberg.table import FileScanTask, Table
from sqlalchemy.exc import SQLAlchemyError

from connectors.config import ConnectorConfig, IcebergSinkSpec
from connectors.errors import ConfigurationError, SinkUnavailableError
from connectors.sinks.iceberg import CONNECTOR, OFFSETS, SOURCE, TARGET_FILE_BYTES, IcebergSink, offsets_snapshot
from logstore.jobs import StepContext, StepRecord
from logstore.net import mask_userinfo

if TYPE_CHECKING:
    from pyiceberg.manifest import DataFile
    from pyiceberg.table.metadata import TableMetadata

logger = logging.getLogger(__name__)
DEFAULT_EXPIRE_SECONDS = 7 * 86400  # snapshots kept for time travel and for readers still on them
DEFAULT_ORPHAN_SECONDS = 86400  # an unreferenced file younger than this may belong to a commit in flight
ATTEMPTS = 8  # commits tried per partition before SinkUnavailableError (the runner runs the step again)
COMPACTED = "cellstream.compacted"  # snapshot summary: the partition a compaction rewrote
_EPOCH = dt.date(1970, 1, 1)
_NO_RETRY = {"commit.retry.num-retries": "0"}  # pyiceberg's retry would commit the offsets as they were


def small(data_file: DataFile, target_bytes: int) -> bool:
    """Whether a data file is small enough to merge: under 3/4 of the target (Iceberg's min-file-size-bytes)."""
    return data_file.file_size_in_bytes < target_bytes * 3 // 4


def plan(config: ConnectorConfig, params: dict[str, Any]) -> list[StepRecord]:
    """The steps of a compaction of ``config``'s Iceberg tables (see the module docstring).

    Args:
        config: the connector, whose sink is ``type: iceberg``.
        params: the job's parameters (:func:`connectors.compaction.compaction_params`).

    Returns:
        One step per (table, closed day partition) with small files to merge, then the expiry step.

    Raises:
        SinkUnavailableError: the catalog or the warehouse cannot be read.
    """
    target, before = int(params["target_bytes"]), str(params["before"])
    steps: list[StepRecord] = []
    with _tables(config) as tables:
        expiry = StepRecord(name="expire snapshots", params={"expire": True}, total=len(tables))
        for column, table in tables:
            by_day: dict[str, int] = {}
            for task in _live(table):
                day = _day(task.file)
                if day < before and small(task.file, target):
                    by_day[day] = by_day.get(day, 0) + 1
            steps.extend(StepRecord(name=f"{column}/created_at_day={day}", params={"column": column, "day": day},
                                    total=count) for day, count in sorted(by_day.items()) if count > 1)
    return [*steps, expiry]


def run_step(config: ConnectorConfig, step: StepRecord, context: StepContext) -> None:
    """Run one step planned by :func:`plan`.

    Raises:
        SinkUnavailableError: the catalog or the warehouse failed, or the partition's commit lost
            ``ATTEMPTS`` races in a row (retriable).
    """
    params = context.job.params
    with _tables(config, only=None if step.params.get("expire") else step.params["column"]) as tables:
        if step.params.get("expire"):
            now = time.time()
            for n, (_, table) in enumerate(tables):
                context.check()
                expire(table, older_than=now - float(params.get("expire_older_than", DEFAULT_EXPIRE_SECONDS)),
                       orphans_before=now - float(params.get("orphan_age", DEFAULT_ORPHAN_SECONDS)))
                context.progress(n + 1, len(tables))
            return
        for _, table in tables:
            if compact_partition(table, step.params["day"], int(params["target_bytes"]), context):
                return
        context.progress(step.total or 0, step.total)  # done before (a run that died after its commit), or gone


def compact_partition(table: Table, day: str, target_bytes: int, context: StepContext) -> int:
    """Merge the small files of ``table``'s partition of ``day`` into files of about ``target_bytes``, in one
    snapshot (see the module docstring); the files merged (0: fewer than two were left).

    Raises:
        SinkUnavailableError: ``ATTEMPTS`` commits in a row lost a race.
    """
    name = f"{table.name()[-1]}/created_at_day={day}"
    for attempt in range(1, ATTEMPTS + 1):
        inputs = [t for t in _live(table) if _day(t.file) == day and small(t.file, target_bytes)]
        if len(inputs) < 2:
            return 0
        merged = _read(table, inputs, context)
        written = _write(table, merged, target_bytes, sum(t.file.file_size_in_bytes for t in inputs), context)
        context.check()  # the last moment a pause or cancel leaves the partition as it was
        while True:
            try:
                _replace(table, [t.file for t in inputs], written, day)
            except CommitFailedException as exc:
                table = _reload(table)
                live = {t.file.file_path for t in _live(table)}
                if all(t.file.file_path in live for t in inputs):
                    logger.info("compaction: %s: a commit landed meanwhile (%s); committing on top of it", name, exc)
                    continue  # appends do not touch our inputs: the same new files, on the new head
                logger.warning("compaction: %s: attempt %d of %d: input files were replaced meanwhile; planning "
                               "again", name, attempt, ATTEMPTS)
                for data_file in written:
                    table.io.delete(data_file.file_path)
                break
            logger.info("compaction: %s: %d files merged into %d", name, len(inputs), len(written))
            context.progress(len(inputs), len(inputs))
            return len(inputs)
        table = _reload(table)
    raise SinkUnavailableError(f"compaction of {name}: {ATTEMPTS} plans in a row lost a race with other writers")


def expire(table: Table, *, older_than: float, orphans_before: float) -> dict[str, int]:
    """Expire ``table``'s snapshots committed before ``older_than`` (a Unix time) but the current one and each
    connector's newest carrying its offsets; delete the files only they referenced, and the orphan files last
    modified before ``orphans_before``.

    Returns:
        ``{"snapshots": expired, "files": deleted with them, "orphans": orphan files deleted}``.
    """
    for _ in range(ATTEMPTS):
        metadata = table.metadata
        keep = {s.snapshot_id for s in (metadata.current_snapshot(),) if s is not None}
        keep |= {ref.snapshot_id for ref in metadata.refs.values()}
        connectors = {s.summary.get(CONNECTOR) for s in metadata.snapshots if s.summary is not None}
        for connector in {c for c in connectors if isinstance(c, str)}:
            newest = offsets_snapshot(metadata, connector)
            if newest is not None:
                keep.add(newest.snapshot_id)
        cutoff = int(older_than * 1000)
        doomed = [s.snapshot_id for s in metadata.snapshots if s.timestamp_ms < cutoff and s.snapshot_id not in keep]
        if not doomed:
            return {"snapshots": 0, "files": 0, "orphans": _remove_orphans(table, orphans_before)}
        before = _referenced(table, metadata)
        try:
            table.maintenance.expire_snapshots().by_ids(doomed).commit()
        except CommitFailedException:
            table = _reload(table)
            continue
        table = _reload(table)
        gone = before - _referenced(table, table.metadata)
        for path in gone:
            table.io.delete(path)
        logger.info("expiry: %s: %d snapshots expired, %d files deleted", ".".join(table.name()), len(doomed),
                    len(gone))
        orphans = _remove_orphans(table, orphans_before)
        return {"snapshots": len(doomed), "files": len(gone), "orphans": orphans}
    raise SinkUnavailableError(f"expiry of {'.'.join(table.name())}: {ATTEMPTS} commits lost a race")


def compaction_summary(metadata: TableMetadata, day: str) -> dict[str, str]:
    """The compaction snapshot's summary: the newest offsets carried forward, and the partition rewritten."""
    newest = offsets_snapshot(metadata)
    summary = newest.summary if newest is not None else None
    found = {key: summary.get(key) for key in (CONNECTOR, OFFSETS, SOURCE)} if summary is not None else {}
    carried = {key: str(value) for key, value in found.items() if value is not None}
    return {**carried, COMPACTED: f"created_at_day={day}"}


# -- helpers -------------------------------------------------------------------------------------------
@contextmanager
def _tables(config: ConnectorConfig, only: str | None = None) -> Iterator[list[tuple[str, Table]]]:
    """The connector's existing tables, (column, table), loaded now; catalog errors as SinkUnavailableError."""
    assert isinstance(config.sink, IcebergSinkSpec)
    sink = IcebergSink(config.sink, config.name)
    try:
        with _unavailable("reading the catalog"):
            found = []
            for column in config.columns if only is None else [only]:
                try:
                    table = sink.catalog().load_table(sink.identifier(column))
                except NoSuchTableError:
                    continue
                found.append((column, _without_retries(table)))
        with _unavailable("compacting"):
            yield found
    finally:
        sink.close()


@contextmanager
def _unavailable(doing: str) -> Iterator[None]:
    try:
        yield
    except (SQLAlchemyError, OSError) as exc:
        message = mask_userinfo(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise SinkUnavailableError(f"iceberg compaction: {doing}: {message}") from None


def _without_retries(table: Table) -> Table:
    table.metadata = table.metadata.model_copy(update={"properties": {**table.metadata.properties, **_NO_RETRY}})
    return table


def _reload(table: Table) -> Table:
    return _without_retries(table.catalog.load_table(table.name()))


def _live(table: Table) -> list[FileScanTask]:
    return list(table.scan().plan_files()) if table.current_snapshot() is not None else []


def _day(data_file: DataFile) -> str:
    return (_EPOCH + dt.timedelta(days=int(data_file.partition[0]))).isoformat()


def _read(table: Table, inputs: list[FileScanTask], context: StepContext) -> pa.Table:
    """The rows of ``inputs`` as the table's current schema has them, in (shard, added_id) order."""
    schema = table.schema()
    scan = ArrowScan(table.metadata, table.io, schema, AlwaysTrue())
    parts = []
    for n, task in enumerate(inputs):
        context.throttle.wait(1)
        parts.append(scan.to_table([task]))
        context.progress(n, len(inputs))
    merged = pa.concat_tables(parts).cast(schema_to_pyarrow(schema))
    return merged.take(pc.sort_indices(merged, [("shard", "ascending"), ("added_id", "ascending")]))


def _write(table: Table, rows: pa.Table, target_bytes: int, input_bytes: int,
           context: StepContext) -> list[DataFile]:
    """``rows`` (one partition's) as data files of about ``target_bytes`` on disk, with pyiceberg's writer.

    pyiceberg cuts files by Arrow bytes; the rows a file takes are measured in Parquet bytes instead: guessed
    from the inputs first, then from each file written."""
    metadata = table.metadata.model_copy(update={"properties": {**table.metadata.properties,
                                                                 TARGET_FILE_BYTES: str(1 << 62)}})
    per_row = input_bytes / max(rows.num_rows, 1)
    written: list[DataFile] = []
    start = 0
    try:
        while start < rows.num_rows:
            context.check()
            count = max(1, int(target_bytes / per_row))
            chunk = rows.slice(start, count)
            files = list(_dataframe_to_data_files(table_metadata=metadata, io=table.io, df=chunk))
            written.extend(files)
            start += chunk.num_rows
            per_row = max(1.0, sum(f.file_size_in_bytes for f in files) / chunk.num_rows)
    except BaseException:
        for data_file in written:  # a stop or a failure: nothing references them
            table.io.delete(data_file.file_path)
        raise
    return written


def _replace(table: Table, removed: list[DataFile], added: list[DataFile], day: str) -> None:
    """One snapshot deleting ``removed`` and adding ``added``; CommitFailedException when the branch moved."""
    transaction = table.transaction()
    summary = compaction_summary(table.metadata, day)
    with transaction.update_snapshot(snapshot_properties=summary).overwrite() as overwrite:
        for data_file in removed:
            overwrite.delete_data_file(data_file)
        for data_file in added:
            overwrite.append_data_file(data_file)
    transaction.commit_transaction()


def _referenced(table: Table, metadata: TableMetadata) -> set[str]:
    """Every file ``metadata`` references: its metadata files, and each snapshot's manifest list, manifests
    and live data files (as local paths)."""
    out = {_local(table.metadata_location)} | {_local(m.metadata_file) for m in metadata.metadata_log}
    manifests = {}
    for snapshot in metadata.snapshots:
        out.add(_local(snapshot.manifest_list))
        for manifest in snapshot.manifests(table.io):
            manifests[manifest.manifest_path] = manifest
    for path, manifest in manifests.items():
        out.add(_local(path))
        out.update(_local(e.data_file.file_path) for e in manifest.fetch_manifest_entry(table.io, discard_deleted=True))
    return out


def _remove_orphans(table: Table, before: float) -> int:
    """Delete the files under the table's location that nothing references and last changed before ``before``."""
    root = Path(_local(table.location()))
    if not root.is_dir():
        return 0
    referenced = _referenced(table, table.metadata)
    removed = 0
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if path not in referenced and os.stat(path).st_mtime < before:
                os.unlink(path)
                removed += 1
    if removed:
        logger.info("expiry: %s: %d orphan files deleted", ".".join(table.name()), removed)
    return removed


def _local(uri: str) -> str:
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise ConfigurationError(f"iceberg compaction: {uri} is not a local file (the warehouse must be one)")
    return os.path.normpath(urllib.parse.unquote(parsed.path))

