"""The indexer error hierarchy.

Every error the runtime raises is an :class:`IndexerError` or the project's
:class:`ConfigurationError`; ``retriable`` tells the
caller whether the same call may succeed later. Handlers raise what they like: the
retry policy (:mod:`indexer.runtime.policy`) decides from ``retriable`` (an exception without
the attribute is retried), and :class:`NonRetriableError` is the one users raise to
send a cell to the dead-letter queue at once.
"""

from __future__ import annotations

from typing import Any

from logstore.errors import CellstreamError, ConfigFileError
from logstore.errors import ConfigurationError as ConfigurationError  # the project's one class, re-exported


class IndexerError(CellstreamError):
    """Root of every indexer error but :class:`ConfigurationError`, the project's one class for options that
    do not fit (here: the app's options or handlers: a bad name, no handler for a column, ...)."""


class NonRetriableError(IndexerError):
    """Raise it (or a subclass) in a handler when retrying cannot help: the cell is dead-lettered at once."""


class RetriableError(IndexerError):
    """Raise it in a handler for a failure that may pass (the default for exceptions without ``retriable``)."""

    retriable = True


class HandlerStalledError(IndexerError):
    """A handler has more open dead letters than the app allows: it stopped instead of adding more.

    Offsets stay before the cell that would have exceeded the threshold, so after the
    cause is fixed (and entries replayed or discarded) a restart carries on from there.
    """

    def __init__(self, app: str, handler: str, open_entries: int, threshold: int, error: str) -> None:
        self.app, self.handler, self.open_entries, self.threshold = app, handler, open_entries, threshold
        super().__init__(
            f"app {app}: handler {handler} stopped: {open_entries} open dead letters already, the stall "
            f"threshold is {threshold} (last error: {error}); triage with `cellstream dlq --app ... stats`"
        )


class TakenOverError(IndexerError):
    """Another process of the same app took this one's shards over (started with the same name)."""


class SourceUnavailableError(IndexerError):
    """The cell source (the Kafka cluster in Kafka mode) cannot be reached or refused a request."""

    retriable = True


class CommitRefusedError(IndexerError):
    """The consumer group refused a commit (Kafka mode): this member is rebalancing or was fenced. The
    partitions' revocation commits them instead, or their next owner starts from the last commit."""

    retriable = True


class DrainTimeoutError(IndexerError):
    """``drain`` did not reach the end of the log in time; ``counts`` says what was done."""

    retriable = True

    def __init__(self, timeout: float, counts: Any) -> None:
        self.counts = counts
        super().__init__(f"the log was not drained within {timeout:g}s ({counts})")


class EntryNotFoundError(IndexerError):
    """No dead-letter entry of this app has that id."""


class EntryStateError(IndexerError):
    """The entry's status does not allow the operation (e.g. discarding a resolved entry)."""


class InvalidFilterError(IndexerError, ValueError):
    """A dead-letter filter names an unknown field or gives a bad value."""


class HandlerMissingError(IndexerError):
    """A dead letter names a handler the app no longer has, so it cannot be replayed."""


class InvalidPolicyError(ConfigurationError, ValueError):
    """A redrive policy (:mod:`indexer.runtime.redrive`) has an unknown field or a bad value: declared in an
    app's code or a connector's file, or given by an operator (``cellstream dlq policy set``, the console)."""


# -- secondary indexes -----------------------------------------------------------
# A bad index definition file is the project's ConfigFileError; its old name stays for callers that catch it.
DefinitionError = ConfigFileError


class EntryFieldError(NonRetriableError):
    """A cell's body cannot give an index entry: a declared field is missing or has the wrong type."""

    def __init__(self, index: str, field: str, message: str) -> None:
        self.index, self.field = index, field
        super().__init__(f"index {index}: field {field}: {message}")


class IndexNotFoundError(IndexerError):
    """No index (or no such version of it) is in the catalog."""


class IndexStateError(IndexerError):
    """The version's state does not allow the operation (activating one that is not backfilled, ...)."""


class InvalidQueryError(IndexerError, ValueError):
    """A query names a field that is not a query key, gives a value of the wrong type, or a bad option."""
