"""What a migration reads from the relational database it moves a table out of: the table in primary-key chunks,
and the changes its log records, both placed on one axis of log positions.

A migration copies the table while it captures the live changes, without locks: each chunk is read in a
snapshot whose log position is known (every change the chunk does not show has a commit position above it),
and every change carries the position of its commit. With the cells' ref_key set from those positions, the
latest cell of a row is the row's newest state whichever of the copy and the change stream wrote it first (the
way Netflix DBLog interleaves chunks with the log, without its watermark windows: cells keep every version).

A backend (PostgreSQL: :mod:`connectors.migration.sources.postgres`; MySQL/MariaDB:
:mod:`connectors.migration.sources.mysql`) implements :class:`MigrationSource` whole, in one module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

Key = tuple[Any, ...]  # a row's primary-key values, in the key's column order


class SourceRow(NamedTuple):
    """A row of the source table: its key and every column's value, as the driver gives them."""

    key: Key
    values: dict[str, Any]


class Chunk(NamedTuple):
    """Rows in key order after a key, read in one snapshot.

    ``position`` is a log position at or below the snapshot's: a change the rows do not show committed above
    it. ``last`` is the chunk's last key (None: the table held no row after the key asked for)."""

    rows: list[SourceRow]
    position: int
    last: Key | None


class Change(NamedTuple):
    """A row's change as the source's log recorded it. ``values`` is the row after an upsert (every column)
    and None for a delete; ``position`` is its transaction's commit position, the same for every change of a
    transaction and increasing from one transaction to the next."""

    op: Literal["upsert", "delete"]
    key: Key
    values: dict[str, Any] | None
    position: int


class ChangeLag(NamedTuple):
    """How far the captured changes are behind the source: the log between the position acknowledged last and
    the source's current one, in bytes, and the age of the oldest change not yet acknowledged (0 when none)."""

    bytes: int
    seconds: float


class SourceLoad(NamedTuple):
    """How busy the source is now: statements running on it (not counting the migration's own), and how far its
    replicas are behind it in seconds (None when the source cannot tell: no replica, or a server that does not
    report its replicas' lag)."""

    running: int
    replica_lag: float | None


class MigrationSource(ABC):
    """One source table of a migration. Implementations are used from one thread at a time."""

    @abstractmethod
    def key_columns(self) -> list[str]:
        """The primary key's columns, in order. Raises MigrationSourceError when the table has none."""

    @abstractmethod
    def columns(self) -> list[str]:
        """Every column of the table, in table order."""

    @abstractmethod
    def read_chunk(self, after: Key | None, limit: int) -> Chunk:
        """Up to ``limit`` rows with a key above ``after`` (None: from the first), in key order, read in one
        short snapshot that holds no lock on the table beyond the read."""

    @abstractmethod
    def start_changes(self) -> int:
        """Begin capturing changes (a replication slot and publication; a binlog position), or find the capture
        begun before: idempotent. Returns the position from which every committed change will be read."""

    @abstractmethod
    def read_changes(self, limit: int) -> list[Change]:
        """The next changes after the position acknowledged last, in commit order, at most about ``limit``
        (a transaction is never split). The same changes come again until acknowledged: at least once."""

    @abstractmethod
    def acknowledge(self, position: int) -> None:
        """The changes up to ``position`` are stored: the source may free its log up to there."""

    @abstractmethod
    def change_lag(self) -> ChangeLag:
        """How far the capture is behind the source now."""

    @abstractmethod
    def load(self) -> SourceLoad:
        """The source's load now, for the copy's throttle (gh-ost's ``--max-load``)."""

    @abstractmethod
    def stop_changes(self) -> None:
        """End the capture and free what holds the source's log (drop the slot): idempotent."""

    @abstractmethod
    def key_span(self) -> tuple[int, int, int] | None:
        """For a table whose primary key is one integer column: its lowest and highest key, and the table's
        row count as the server estimates it, read from the key's index and the statistics (no scan). None for
        another key, or an empty table: how a sampled diff picks random chunks without walking the key."""

    @abstractmethod
    def skip_keys(self, after: Key | None, count: int) -> Key | None:
        """The key of the ``count``-th row after ``after`` (None: from the first) in key order, read from the
        primary key alone, or None when fewer rows follow: how a sampled diff steps over the chunks it does not
        compare without reading their rows."""

    @abstractmethod
    def rows_between(self, low: Key | None, high: Key | None) -> list[SourceRow]:
        """The rows with ``low < key <= high`` (None: unbounded), in key order: what a diff compares."""

    @abstractmethod
    def read_row(self, key: Key) -> SourceRow | None:
        """The row with primary key ``key`` now, its values converted as a chunk's are (None: no such row): what
        the read facade compares with the cells.

        Raises:
            MigrationSourceError: ``key`` does not fit the primary key, or the read was refused;
            MigrationSourceUnavailableError: the server did not answer.
        """

    @abstractmethod
    def log_position(self) -> int:
        """The source's log position now, as a boundary: every change committed before the call has a position
        below it, every change committed after it one at or above it (what ``migrate reverse`` records, so that
        the capture skips the flow back's own writes and applies every later one).

        Raises:
            MigrationSourceError: the position cannot be read (a privilege missing);
            MigrationSourceUnavailableError: the server did not answer.
        """

    @abstractmethod
    def write_rows(self, upserts: Sequence[Mapping[str, Any]], deletes: Sequence[Key]) -> None:
        """Make the table hold each row of ``upserts`` and none of ``deletes``, in one transaction: the flow back
        of a migration whose writes are switched to the store, and the write facade's source side.

        Args:
            upserts: rows by column name, each with every primary-key column: a row that exists gets the columns
                given (the others keep their values), a new one gets them and the table's defaults. Values are
                in the forms the cells hold (:func:`connectors.migration.mapping.json_value`'s: ISO 8601 times,
                Decimals as text, bytes as base64, JSON as itself), converted back by each column's type.
            deletes: primary keys, in the key's column order.

        Raises:
            MigrationSourceError: the source refused (a value a column cannot take, a constraint): nothing was
                written; MigrationSourceUnavailableError: the server did not answer (nothing was written, or all).
        """

    @abstractmethod
    def close(self) -> None:
        """Close the connections (the capture, if started, stays for the next run)."""
