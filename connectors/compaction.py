"""Compaction of a connector's Parquet lake: small files of closed partitions rewritten into target-sized ones,
as a job (:mod:`logstore.jobs`: resumable, throttled, paused and cancelled between files).

A partition (``<column>/date=D``) is *closed* when its day is before the job's ``before`` date (by default the
day the job was planned, in UTC): the connector hardly writes there any more, but it may (a late shard, a
dead letter replayed), and that is allowed for. One step compacts one partition:

1. its small files (under ``target_bytes``) are read, cast to the column's registry types (a field widened
   since a file was written is widened in it too), sorted by (shard, added_id) and written as files of about
   ``target_bytes`` (at most the sink's ``max_rows`` rows) into a new folder under the compaction's staging
   folder, beside hard links to the partition's files it keeps;
2. under the lake's lock, files committed to the partition since step 1 are linked in as well, and one commit
   swaps the new folder with the partition's (:mod:`connectors.sinks.commits`): a reader listing the partition
   sees the old files or the new ones, never both and never neither. A reader that listed the old files and
   opens one after the swap gets "file not found" and tries again; it never counts a row twice.

A step killed half-way leaves only staged files, which the next writer to open the lake removes; run again,
the step plans from the partition as it is then. So the step is idempotent, and a job resumed after its
runner died (``cellstream jobs resume``) goes on from the first partition not done.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from connectors.config import ConnectorConfig, IcebergSinkSpec, ParquetSinkSpec, load_connector
from connectors.errors import CompactionRaceError, ConfigurationError, SinkUnavailableError
from connectors.sinks.base import json_text
from connectors.sinks.commits import CommitLog
from connectors.sinks.parquet import ARROW_TYPES, SCHEMA_FILE, write_staged
from logstore.jobs import JobKind, StepContext, StepRecord

logger = logging.getLogger(__name__)
DEFAULT_TARGET_BYTES = 128 << 20


def small_files(folder: Path, target_bytes: int) -> list[Path]:
    """The partition's data files under ``target_bytes``, in name order."""
    return sorted(p for p in folder.glob("*.parquet") if not p.name.startswith(".")
                  and p.stat().st_size < target_bytes)


class LakeCompaction(JobKind):
    """The ``compact`` job kind for the plain Parquet layout (and, for a ``type: iceberg`` sink, the steps of
    :mod:`connectors.iceberg_compaction`).

    Parameters (the job's ``params``): ``connector_file`` (the connector's YAML, absolute: the lake's root and
    ``max_rows`` come from it, and no secret is copied into the job record), ``target_bytes``, ``before``
    (ISO date: partitions of earlier days are compacted); for Iceberg, ``expire_older_than`` (seconds).
    """

    name: ClassVar[str] = "compact"
    unit: ClassVar[str] = "files"

    def plan(self, params: dict[str, Any]) -> list[StepRecord]:
        config, target, before = _settings(params)
        if isinstance(config.sink, IcebergSinkSpec):
            from connectors import iceberg_compaction  # pyiceberg: the iceberg extra

            return iceberg_compaction.plan(config, params)
        assert isinstance(config.sink, ParquetSinkSpec)
        steps = []
        for column in config.columns:
            for folder in sorted((config.sink.root / column).glob("date=*")):
                day = folder.name.removeprefix("date=")
                if folder.is_dir() and day < before and len(small_files(folder, target)) > 1:
                    steps.append(StepRecord(name=f"{column}/date={day}", params={"column": column, "date": day},
                                            total=len(small_files(folder, target))))
        return steps

    def run_step(self, step: StepRecord, context: StepContext) -> None:
        config, target, _ = _settings(context.job.params)
        if isinstance(config.sink, IcebergSinkSpec):
            from connectors import iceberg_compaction

            return iceberg_compaction.run_step(config, step, context)
        assert isinstance(config.sink, ParquetSinkSpec)
        root = config.sink.root
        partition = f"{step.params['column']}/date={step.params['date']}"
        folder = root / partition
        inputs = small_files(folder, target) if folder.is_dir() else []
        if len(inputs) < 2:
            context.progress(step.total or 0, step.total)
            return  # done before (a run that died after its commit), or nothing left to merge
        log = CommitLog(root, connector=config.name)
        try:
            tables, input_bytes = [], sum(p.stat().st_size for p in inputs)
            for n, path in enumerate(inputs):
                context.throttle.wait(1)
                tables.append(pq.read_table(path))
                context.progress(n, len(inputs))
            merged = _merge(tables, _registry(root / step.params["column"]))
            staged = log.staging / f"swap.{partition.replace('/', '.')}"
            os.mkdir(staged, 0o700)
            per_file = _rows_per_file(merged, input_bytes, target, config.sink.max_rows)
            for start in range(0, max(merged.num_rows, 1), per_file):
                context.check()
                written = write_staged(merged.slice(start, per_file), log.staging, partition,
                                       config.sink.compression)
                os.replace(written.path, staged / Path(written.final).name)
            merged_away = {p.name for p in inputs}

            def keep_the_rest() -> None:  # under the lake's lock: no commit can add a file meanwhile
                gone = sorted(name for name in merged_away if not (folder / name).exists())
                if gone:  # another compaction of the partition committed first (this runner's lease lapsed)
                    raise CompactionRaceError(f"compaction of {partition}: {len(gone)} of its files were merged "
                                              f"by another compaction meanwhile ({gone[0]}...); planned again")
                for path in folder.glob("*.parquet"):
                    if path.name not in merged_away and not (staged / path.name).exists():
                        os.link(path, staged / path.name)
            context.check()  # the last moment a pause or cancel leaves the partition as it was
            record = log.commit([], {}, None, swaps={partition: staged}, before_record=keep_the_rest)
            logger.info("compaction: %s: %d files merged into %d (commit %d)", partition, len(inputs),
                        len(list((root / partition).glob("*.parquet"))), record.seq if record else 0)
            context.progress(len(inputs), len(inputs))
        except OSError as exc:
            raise SinkUnavailableError(f"compaction of {partition} failed: {exc}") from exc
        finally:
            log.close()

    def describe(self, record: Any) -> str:
        return f"compact the lake of {record.params.get('connector_file')} (partitions before " \
               f"{record.params.get('before')})"


def compaction_params(file: Path, *, target_bytes: int = DEFAULT_TARGET_BYTES, before: dt.date | None = None,
                      expire_older_than: dt.timedelta | None = None) -> dict[str, Any]:
    """A compaction job's parameters for the connector in ``file``.

    Args:
        file: the connector's YAML.
        target_bytes: about this many bytes a file.
        before: compact the partitions of days before this one (default: today, UTC).
        expire_older_than: Iceberg: expire snapshots older than this (default 7 days).

    Raises:
        ConfigFileError: the file does not load.
        ConfigurationError: its sink is not one compaction knows, or ``expire_older_than`` is given for a
            Parquet lake (which has no snapshots).
    """
    config = load_connector(file)
    if not isinstance(config.sink, (ParquetSinkSpec, IcebergSinkSpec)):
        raise ConfigurationError(f"connector {config.name}: compaction is for a Parquet lake or Iceberg tables, "
                                 f"its sink is {config.sink.type}")
    params: dict[str, Any] = {"connector_file": str(file.resolve()), "target_bytes": target_bytes,
                              "before": (before or dt.datetime.now(dt.UTC).date()).isoformat()}
    if isinstance(config.sink, IcebergSinkSpec):
        from connectors.iceberg_compaction import DEFAULT_EXPIRE_SECONDS

        params["expire_older_than"] = (expire_older_than.total_seconds() if expire_older_than is not None
                                       else DEFAULT_EXPIRE_SECONDS)
    elif expire_older_than is not None:
        raise ConfigurationError(f"connector {config.name}: snapshot expiry is for Iceberg tables; a Parquet "
                                 "lake has no snapshots")
    return params


def _settings(params: dict[str, Any]) -> tuple[ConnectorConfig, int, str]:
    try:
        config = load_connector(Path(params["connector_file"]))
        target, before = int(params["target_bytes"]), str(params["before"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigurationError(f"compaction: bad parameters {params!r}: {exc}") from None
    if not isinstance(config.sink, (ParquetSinkSpec, IcebergSinkSpec)):
        raise ConfigurationError(f"connector {config.name}: compaction is for a Parquet lake or Iceberg tables")
    return config, target, before


def _registry(column_folder: Path) -> dict[str, str]:
    path = column_folder / SCHEMA_FILE
    try:
        found = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as exc:
        raise SinkUnavailableError(f"compaction: cannot read {path}: {exc}") from exc
    return dict(found)


def _merge(tables: list[pa.Table], registry: dict[str, str]) -> pa.Table:
    """One table of ``tables``' rows; a field's type is the registry's now (files written before it widened
    hold the narrower type), then the rows in (shard, added_id) order."""
    cast = []
    for table in tables:
        for name in table.column_names:
            kind = registry.get(name)
            if kind is not None and table.schema.field(name).type != ARROW_TYPES[kind]:
                table = table.set_column(table.column_names.index(name), name, _cast(table[name], kind))
        cast.append(table)
    merged = pa.concat_tables(cast, promote_options="permissive")
    return merged.take(pc.sort_indices(merged, [("shard", "ascending"), ("added_id", "ascending")]))


def _cast(values: pa.ChunkedArray, kind: str) -> pa.ChunkedArray:
    if kind in ("string", "json") and not pa.types.is_string(values.type):
        # As the sink writes a value of another kind into a string column: its JSON text.
        return pa.chunked_array([pa.array([None if v is None else json_text(v) for v in values.to_pylist()],
                                          pa.string())])
    return values.cast(ARROW_TYPES[kind])


def _rows_per_file(table: pa.Table, input_bytes: int, target_bytes: int, max_rows: int) -> int:
    per_row = max(1.0, input_bytes / max(table.num_rows, 1))
    return max(1, min(max_rows, int(target_bytes / per_row)))
