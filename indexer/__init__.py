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

from .app import App
from .config import AppConfig
from .deadletters import DeadLetter
from .dlq import DeadLetterQueue, DLQFilter, ReplayResult
from .errors import (
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
from .handlers import Counts, Trigger

__all__ = [
    "App",
    "AppConfig",
    "ConfigurationError",
    "Counts",
    "DLQFilter",
    "DeadLetter",
    "DeadLetterQueue",
    "DrainTimeoutError",
    "EntryNotFoundError",
    "EntryStateError",
    "HandlerMissingError",
    "HandlerStalledError",
    "IndexerError",
    "InvalidFilterError",
    "NonRetriableError",
    "ReplayResult",
    "RetriableError",
    "SourceUnavailableError",
    "TakenOverError",
    "Trigger",
]
