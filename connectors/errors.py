"""The connectors' errors: one hierarchy, with a ``retriable`` flag the runtime's retry policy reads."""

from __future__ import annotations

from logstore.errors import CellstreamError
from logstore.errors import ConfigurationError as ConfigurationError  # the project's one class, re-exported


class ConnectorError(CellstreamError):
    """Base of every error a connector raises but :class:`ConfigurationError`, the project's one class for
    options that do not fit (here: a connector file, a sink root that cannot be created)."""


class ConversionError(ConnectorError):
    """A cell that cannot become a warehouse row (its body does not fit): it goes to the dead-letter queue."""


class SinkUnavailableError(ConnectorError):
    """The warehouse could not be written now (disk full, server down): the batch is tried again."""

    retriable = True


class CompactionRaceError(SinkUnavailableError):
    """Another compaction changed the partition while this one merged it: nothing was committed, and the step,
    run again, plans from the partition as it is now (retriable)."""


class MigrationSourceError(ConnectorError):
    """The source of a migration cannot be read as one: no such table, no primary key, a server not set up for
    change capture (``wal_level``, ``binlog_format``), a privilege missing. The message says what to change."""


class MigrationSourceUnavailableError(MigrationSourceError):
    """The source database did not answer (retriable: the copy or the capture goes on from where it was)."""

    retriable = True


class MigrationStateError(ConnectorError):
    """A migration step that does not fit the migration's state: no such migration, a step out of order, a
    name already moving another table. The message says what comes first."""


class MigrationSwitchingError(MigrationStateError):
    """A write held while a migration's writes move between the source and the store (``migrate switch
    --writes``, ``migrate reverse``) longer than the writer waits: retriable, the move ends in seconds (or is
    called off, and the writes go on where they went)."""

    retriable = True
