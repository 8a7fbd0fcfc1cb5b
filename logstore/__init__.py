"""logstore: a sharded, append-only cell store whose shards are logs.

>>> import logstore
>>> store = logstore.open("sqlite:///data")                 # doctest: +SKIP
>>> store.put_cell(trip, "BASE", 1, {"city": "Aarhus"})     # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from logstore.errors import (
    AuthenticationError,
    CellConflictError,
    CellstreamError,
    ConfigurationError,
    CorruptCellError,
    InvalidArgumentError,
    InvalidCellError,
    LogstoreError,
    MissingExtraError,
    ShardMovedError,
    StorageError,
    StorageUnavailableError,
    StoreNotFoundError,
)
from logstore.extras import require
from logstore.lazy import lazy_exports

if TYPE_CHECKING:
    from logstore.cell import Cell, PackedCell
    from logstore.config import DEFAULT_SHARDS, ClusterConfig, MySQLTarget, NodeTarget, StoreOptions
    from logstore.offsets import OffsetRecord
    from logstore.persistence import ChangedCounts, NodeRecorder, UndecodedPages
    from logstore.store import ShardInfo, Store

__all__ = [
    "DEFAULT_SHARDS",
    "AuthenticationError",
    "Cell",
    "CellConflictError",
    "CellstreamError",
    "ChangedCounts",
    "ClusterConfig",
    "ConfigurationError",
    "CorruptCellError",
    "InvalidArgumentError",
    "InvalidCellError",
    "LogstoreError",
    "MissingExtraError",
    "OffsetRecord",
    "PackedCell",
    "ShardInfo",
    "ShardMovedError",
    "StorageError",
    "StorageUnavailableError",
    "Store",
    "StoreNotFoundError",
    "StoreOptions",
    "UndecodedPages",
    "open",
]

# Imported on first use, so that `import logstore` (and the CLI's --help) stays cheap: pydantic models
# are built when their module is imported.
_LAZY = {
    "Cell": "logstore.cell",
    "PackedCell": "logstore.cell",
    "DEFAULT_SHARDS": "logstore.config",
    "ClusterConfig": "logstore.config",
    "StoreOptions": "logstore.config",
    "OffsetRecord": "logstore.offsets",
    "ChangedCounts": "logstore.persistence",
    "UndecodedPages": "logstore.persistence",
    "ShardInfo": "logstore.store",
    "Store": "logstore.store",
}

__getattr__ = lazy_exports(__name__, _LAZY)


def _recorder(name: str, target: NodeTarget, options: StoreOptions, token: str | None = None,
              replicas: Sequence[MySQLTarget] = ()) -> NodeRecorder:
    from logstore.config import HttpTarget, MySQLTarget

    if isinstance(target, HttpTarget):
        from logstore.backends.http import HttpRecorder

        return HttpRecorder(name, target, options, token)
    if isinstance(target, MySQLTarget):
        require("mysql", "a MySQL/MariaDB store")
        from logstore.backends.mysql.recorder import MySQLRecorder

        return MySQLRecorder(name, target, options, replicas)
    from logstore.backends.sqlite.recorder import SQLiteRecorder

    return SQLiteRecorder(name, target, options)


def open(target: str | os.PathLike[str], shards: int | None = None, *,  # noqa: A001
         token: str | None = None, create: bool = True, **options: Any) -> Store:
    """Open a logstore instance, creating it when missing (with ``create=False``, StoreNotFoundError instead,
    and nothing is created: for commands that only read).

    ``target`` is ``sqlite:///dir``, ``mysql://user:pw@host:port/db``, the path of a
    cluster file, or ``http://host:port``, a worker node (``cellstream serve``): the
    same API over HTTP, with ``token`` (default: the CELLSTREAM_TOKEN environment
    variable) as its Bearer token. ``shards`` is fixed when the instance is created
    (default 4096); opening an existing instance with another count raises
    ConfigurationError. ``options`` are the fields of :class:`StoreOptions`.
    """
    from pathlib import Path

    from pydantic import ValidationError

    from logstore.config import (
        DEFAULT_SHARDS,
        MAX_SHARDS,
        HttpTarget,
        StoreOptions,
        load_cluster_file,
        parse_node_url,
        single_node,
    )
    from logstore.store import Store, node_meta

    try:
        opts = StoreOptions(**options)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidArgumentError(f"store option {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if shards is not None and (type(shards) is not int or not 1 <= shards <= MAX_SHARDS):
        raise InvalidArgumentError(f"shards must be an integer in [1, {MAX_SHARDS}], got {shards!r}")
    text = os.fspath(target)
    recorders: dict[str, NodeRecorder] = {}
    try:
        if text.startswith(("sqlite:", "mysql:")) or "://" in text:
            node_target = parse_node_url(text)
            if token is not None and not isinstance(node_target, HttpTarget):
                raise InvalidArgumentError("a token is for a worker node's http:// URL only")
            if isinstance(node_target, HttpTarget) and token is None:
                token = os.environ.get("CELLSTREAM_TOKEN") or None
            recorder = _recorder("node0", node_target, opts, token)
            recorders["node0"] = recorder
            found = recorder.read_meta()
            count = shards or (found.shard_count if found else DEFAULT_SHARDS)
            cluster = single_node(text, count)
        else:
            cluster = load_cluster_file(Path(text))
            if shards is not None and shards != cluster.shards:
                raise ConfigurationError(
                    f"cluster file {text} gives {cluster.shards} shards, opened with {shards}"
                )
            for node in cluster.nodes:
                recorders[node.name] = _recorder(node.name, node.target, opts, replicas=node.replica_targets)
        # One node of several that does not answer soon is opened without (its writes are buffered on the
        # others, its reads go to its replicas meanwhile); a store of one node must answer.
        several = len(cluster.nodes) > 1
        soon = opts.retry.model_copy(update={"deadline": opts.buffer_after or 2.0}) if several else None
        for node in cluster.nodes:
            recorder, meta = recorders[node.name], node_meta(cluster, node)
            try:
                if not create and recorder.read_meta(soon) is None:
                    where = node.target.redacted()
                    if "://" not in text:
                        where = f"storage node {node.name} ({where}) of cluster file {text}"
                    raise StoreNotFoundError(f"no store at {where} (create one with `cellstream init`)")
                recorder.initialize(meta, soon)
            except StorageUnavailableError as exc:
                if not several:
                    raise
                logging.getLogger(__name__).warning("storage node %s does not answer (%s); opening without it",
                                                    node.name, exc)
                recorder.defer_initialize(meta)
    except BaseException:
        for recorder in recorders.values():
            recorder.close()
        raise
    return Store(cluster, recorders, opts)
