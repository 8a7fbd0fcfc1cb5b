"""What a connector's sink holds, for ``cellstream connect status``: read-only, from the sink's own records."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from connectors.config import ConnectorConfig, IcebergSinkSpec, ParquetSinkSpec
from connectors.sinks.commits import STAGING_DIR, read_state


def sink_summary(config: ConnectorConfig) -> dict[str, Any]:
    """The sink's totals: for the Parquet lake and the Iceberg tables their data files, their bytes and the
    last commit.

    Args:
        config: the connector's configuration.

    Returns:
        ``{"type": ...}`` and what the sink can tell without writing anything (a lake nothing was
        committed to yet: zero files, no last commit).

    Raises:
        SinkUnavailableError: the lake's commit log cannot be read.
    """
    out: dict[str, Any] = {"type": config.sink.type}
    if isinstance(config.sink, ParquetSinkSpec):
        root = config.sink.root
        files = size = 0
        if root.is_dir():
            for column in config.columns:
                for folder, _, names in os.walk(root / column):
                    for name in names:
                        if name.endswith(".parquet") and not name.startswith("."):
                            files += 1
                            size += os.stat(os.path.join(folder, name)).st_size
        staged = sum(1 for _ in (root / STAGING_DIR).glob("*/*.parquet")) if root.is_dir() else 0
        last = read_state(root).last if root.is_dir() else None
        out.update(files=files, bytes=size, staged_files=staged, last_commit=None if last is None else {
            "seq": last.seq, "kind": last.kind, "at": last.at.isoformat(), "files": len(last.add),
            "rows": last.rows, "partitions_compacted": len(last.swap)})
    elif isinstance(config.sink, IcebergSinkSpec):
        out.update(_iceberg(config))
    return out


def _iceberg(config: ConnectorConfig) -> dict[str, Any]:
    """Totals of the columns' tables from their current snapshots' summaries (Iceberg keeps them there)."""
    from logstore.extras import require

    require("iceberg", "an Iceberg sink's status")
    from connectors.sinks.iceberg import IcebergSink

    assert isinstance(config.sink, IcebergSinkSpec)
    sink = IcebergSink(config.sink, config.name)
    files = size = rows = 0
    last: dict[str, Any] | None = None
    try:
        for column in config.columns:
            table = sink.table(column)
            snapshot = table.current_snapshot() if table is not None else None
            if table is None or snapshot is None:
                continue
            summary = snapshot.summary.additional_properties if snapshot.summary is not None else {}
            files += int(summary.get("total-data-files", 0))
            size += int(summary.get("total-files-size", 0))
            rows += int(summary.get("total-records", 0))
            at = dt.datetime.fromtimestamp(snapshot.timestamp_ms / 1000, dt.UTC)
            if last is None or at.isoformat() > last["at"]:
                operation = snapshot.summary.operation.value if snapshot.summary is not None else "?"
                last = {"seq": snapshot.sequence_number, "kind": operation, "at": at.isoformat(),
                        "table": ".".join(sink.identifier(column)), "files": int(summary.get("added-data-files", 0)),
                        "rows": int(summary.get("added-records", 0)), "partitions_compacted": 0}
    finally:
        sink.close()
    return {"files": files, "bytes": size, "rows": rows, "last_commit": last}
