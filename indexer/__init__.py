"""indexer: the stream-processing runtime over the cell stream.

>>> from indexer import App
>>> app = App("billing", store="sqlite:///data")            # doctest: +SKIP
>>> @app.trigger("BASE", max_attempts=5)                     # doctest: +SKIP
... def bill_rider(cell): ...

Handlers run at least once per cell, in per-shard order; failures are retried with
backoff, then dead-lettered (``app.dlq``); offsets advance only past cells that
succeeded or were dead-lettered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from indexer.errors import (
    ConfigurationError,
    DrainTimeoutError,
    EntryNotFoundError,
    EntryStateError,
    HandlerMissingError,
    HandlerStalledError,
    IndexerError,
    InvalidFilterError,
    NonRetriableError,
    RetriableError,
    SourceUnavailableError,
    TakenOverError,
)
from logstore.lazy import lazy_exports

if TYPE_CHECKING:
    from indexer.indexes.applier import Index
    from indexer.runtime.app import App
    from indexer.runtime.config import AppConfig
    from indexer.runtime.context import Context
    from indexer.runtime.dlq_store import DeadLetter
    from indexer.runtime.dlq_triage import DeadLetterQueue, DLQFilter, ReplayResult
    from indexer.runtime.handlers import Counts, Trigger
    from indexer.runtime.hooks import Hook

__all__ = [
    "App",
    "AppConfig",
    "ConfigurationError",
    "Context",
    "Counts",
    "DLQFilter",
    "DeadLetter",
    "DeadLetterQueue",
    "DrainTimeoutError",
    "EntryNotFoundError",
    "EntryStateError",
    "HandlerMissingError",
    "HandlerStalledError",
    "Hook",
    "Index",
    "IndexerError",
    "InvalidFilterError",
    "NonRetriableError",
    "ReplayResult",
    "RetriableError",
    "SourceUnavailableError",
    "TakenOverError",
    "Trigger",
]

# Imported on first use: `import indexer.errors` (the CLI's exit table) must not build the runtime.
_LAZY = {
    "App": "indexer.runtime.app",
    "AppConfig": "indexer.runtime.config",
    "Context": "indexer.runtime.context",
    "Counts": "indexer.runtime.handlers",
    "Hook": "indexer.runtime.hooks",
    "DLQFilter": "indexer.runtime.dlq_triage",
    "DeadLetter": "indexer.runtime.dlq_store",
    "DeadLetterQueue": "indexer.runtime.dlq_triage",
    "Index": "indexer.indexes.applier",
    "ReplayResult": "indexer.runtime.dlq_triage",
    "Trigger": "indexer.runtime.handlers",
}

__getattr__ = lazy_exports(__name__, _LAZY)
