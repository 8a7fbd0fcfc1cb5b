"""logstore: a sharded, append-only cell store whose shards are logs.

>>> import logstore
>>> store = logstore.open("sqlite:///data")                 # doctest: +SKIP
>>> store.put_cell(trip, "BASE", 1, {"city": "Aarhus"})     # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from logstore.errors import (
    AuthenticationError,
    CellConflictError,
    CellstreamError,
    ConfigFileError,
    ConfigurationError,
    CorruptCellError,
    InvalidArgumentError,
    InvalidCellError,
    JobError,
    JobLeaseLostError,
    JobNotFoundError,
    JobStateError,
    LogstoreError,
    MissingExtraError,
    ShardMovedError,
    StorageError,
    StorageUnavailableError,
    StoreNotFoundError,
    UnknownJobKindError,
)
from logstore.lazy import lazy_exports

if TYPE_CHECKING:
    from logstore.cell import Cell, PackedCell
    from logstore.config import DEFAULT_SHARDS, ClusterConfig, StoreOptions
    from logstore.offsets import OffsetRecord
    from logstore.opening import open  # noqa: A004  # logstore.open, as the API names it
    from logstore.persistence import ChangedCounts, TruncatedPage, UndecodedPages
    from logstore.store import ShardInfo, Store

__all__ = [
    "DEFAULT_SHARDS",
    "AuthenticationError",
    "Cell",
    "CellConflictError",
    "CellstreamError",
    "ChangedCounts",
    "ClusterConfig",
    "ConfigFileError",
    "ConfigurationError",
    "CorruptCellError",
    "InvalidArgumentError",
    "InvalidCellError",
    "JobError",
    "JobLeaseLostError",
    "JobNotFoundError",
    "JobStateError",
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
    "TruncatedPage",
    "UndecodedPages",
    "UnknownJobKindError",
    "open",
]

# Imported on first use, so that `import logstore` (and the CLI's --help) stays cheap: pydantic models
# are built when their module is imported. open() is logstore.opening's; each backend is found in
# logstore.registry.BACKENDS.
_LAZY = {
    "Cell": "logstore.cell",
    "PackedCell": "logstore.cell",
    "DEFAULT_SHARDS": "logstore.config",
    "ClusterConfig": "logstore.config",
    "StoreOptions": "logstore.config",
    "OffsetRecord": "logstore.offsets",
    "open": "logstore.opening",
    "ChangedCounts": "logstore.persistence",
    "TruncatedPage": "logstore.persistence",
    "UndecodedPages": "logstore.persistence",
    "ShardInfo": "logstore.store",
    "Store": "logstore.store",
}

__getattr__ = lazy_exports(__name__, _LAZY)
