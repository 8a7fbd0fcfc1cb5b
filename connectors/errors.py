"""The connectors' errors: one hierarchy, with a ``retriable`` flag the runtime's retry policy reads."""

from __future__ import annotations

from logstore.errors import CellstreamError


class ConnectorError(CellstreamError):
    """Base of every error a connector raises."""


class ConversionError(ConnectorError):
    """A cell that cannot become a warehouse row (its body does not fit): it goes to the dead-letter queue."""


class SinkUnavailableError(ConnectorError):
    """The warehouse could not be written now (disk full, server down): the batch is tried again."""

    retriable = True


class SinkConfigError(ConnectorError):
    """A sink's configuration is wrong (a root that cannot be created, a bad option)."""
