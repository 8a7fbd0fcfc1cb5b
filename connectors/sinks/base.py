"""The sink contract: ``add(cell, position)`` buffers, ``flush()`` makes everything added durable.

The runtime hands a sink the cells of its source partitions in order, then calls
``flush()`` before it commits the source positions (flush-before-commit), so a crash
replays at most the cells after the last commit. Sinks make replays harmless:
writing the same cells again leaves the warehouse as if they were written once.
"""

from __future__ import annotations

import datetime as dt
import json
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from connectors.errors import ConversionError
from logstore import Cell

SEPARATOR = "."  # nested body fields become columns named like Kafka Connect's Flatten does: a.b.c
CELL_COLUMNS = ("row_key", "column", "ref_key", "added_id", "shard", "created_at")


class Position(NamedTuple):
    """Where a cell is in its source: a shard and added_id (logstore), or a partition and offset (Kafka)."""

    partition: int
    offset: int


class Sink(ABC):
    """A warehouse writer for one connector process; its methods are called one at a time.

    ``add`` is ``write(convert(cell), cell, position)``: the runtime converts on its own (a cell that
    cannot convert is dead-lettered before anything of it is buffered), then writes. A position at or
    below the last one written for its column and partition is skipped, so a batch handed over again
    after a failed attempt is not buffered twice.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], int] = {}
        self._uncommitted: dict[tuple[str, int], int] = {}  # positions written since the last commit
        self._begun: set[tuple[str, int]] = set()

    def begin(self, column: str, partition: int, start: int) -> None:
        """The source delivers ``column``'s cells of ``partition`` to this process from position ``start``,
        the first one past the source's last commit. A sink that records positions with its data
        (:meth:`committed`) skips what its own commit holds already: the source's commit follows the sink's,
        so after a crash between the two the source hands over cells the sink has. Only the first call per
        column and partition counts."""
        key = (column, partition)
        if key in self._begun:
            return
        committed = self.committed(column, partition)
        if committed is not None and committed > self._last.get(key, -1):
            self._last[key] = committed
        self._begun.add(key)

    def committed(self, column: str, partition: int) -> int | None:
        """The last position of ``column`` and ``partition`` this sink's own commit record holds (files and
        positions committed as one step), or None: nothing yet, or a sink that keeps no positions and makes
        replays harmless by other means (an upsert)."""
        return None

    def check(self, columns: list[str]) -> None:
        """Refuse, before the source reads anything, what the sink can tell would go wrong for ``columns``
        (ConfigurationError): a refusal later, in a batch, would dead-letter every cell of it."""
        return None

    def uncommitted(self) -> dict[tuple[str, int], int]:
        """(column, partition): the last position written since the last commit; a sink that records
        positions commits these with its data, then calls :meth:`_committed_now`."""
        return dict(self._uncommitted)

    def _committed_now(self, positions: dict[tuple[str, int], int]) -> None:
        """``positions`` (from :meth:`uncommitted`) are committed: forget those not moved on since."""
        for key, offset in positions.items():
            if self._uncommitted.get(key) == offset:
                del self._uncommitted[key]

    def add(self, cell: Cell, position: Position) -> None:
        """Buffer one cell; ConversionError when it cannot become a row (nothing of it is buffered)."""
        self.write(self.convert(cell), cell, position)

    @abstractmethod
    def convert(self, cell: Cell) -> Any:
        """What the cell becomes in the warehouse; ConversionError says why it cannot."""

    def write(self, converted: Any, cell: Cell, position: Position, *, replay: bool = False) -> None:
        """Buffer a converted cell (rotation may write files now). With ``replay`` (a dead letter sent
        again) its position is not checked against the partition's last one, nor recorded."""
        key = (cell.column, position.partition)  # a batch hands each column's cells over on their own
        if key not in self._begun:
            self.begin(cell.column, position.partition, position.offset)
        if not replay and position.offset <= self._last.get(key, -1):
            return
        self._buffer(converted, cell, position)  # a failure here buffers nothing: the cell comes again
        if not replay:
            self._last[key] = self._uncommitted[key] = position.offset
        self._rotate(cell)  # may fail (writing): the row is buffered already, and goes with the next flush

    @abstractmethod
    def _buffer(self, converted: Any, cell: Cell, position: Position) -> None:
        """Take the row into the buffer, as the last step: if this raises, nothing of the row was taken."""

    def _rotate(self, cell: Cell) -> None:
        """Write what the last row's buffer holds if it reached a limit (a sink that rotates files)."""
        return None

    @abstractmethod
    def flush(self) -> None:
        """Make every cell written so far durable in the warehouse."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; what was not flushed is dropped (the source will deliver it again)."""


def flatten(body: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A body's fields as flat columns: nested objects joined with SEPARATOR; lists stay values (the sinks
    store them as JSON text). ConversionError for a field that collides with a cell column or another field."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        if not isinstance(key, str) or not key:
            raise ConversionError(f"body field name {key!r} is not a non-empty string")
        name = prefix + key
        if isinstance(value, dict) and value:
            for inner, item in flatten(value, name + SEPARATOR).items():
                _put(out, inner, item)
        else:
            _put(out, name, value)
    if not prefix:
        for name in out:
            if name in CELL_COLUMNS:
                raise ConversionError(f"body field {name!r} collides with the cell's own column of that name")
    return out


def table_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A body flattened (:func:`flatten`) for a table's typed columns: ConversionError also for an integer that
    does not fit a 64-bit column."""
    fields = flatten(body)
    for name, value in fields.items():
        if type(value) is int and not -(1 << 63) <= value < 1 << 63:
            raise ConversionError(f"body field {name!r}: {value} does not fit a 64-bit integer column")
    return fields


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    if name in out:
        raise ConversionError(f"body fields flatten to {name!r} twice")
    out[name] = value


def json_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def utc_date(when: dt.datetime) -> str:
    """The cell's UTC date, YYYY-MM-DD (the store gives times in UTC already: no conversion then)."""
    return (when if when.tzinfo is dt.UTC else when.astimezone(dt.UTC)).date().isoformat()
