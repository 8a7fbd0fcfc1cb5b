"""A log block: a range of one shard's stored cells as one bytes value, the form a backup keeps them in.

A block holds its cells in added_id order, each as an ASCII head
``{added_id},{created},{ref_key},{column},{size},`` (``created``: UTC ``YYYY-MM-DD HH:MM:SS.ffffff``, as MySQL
writes a ``DATETIME(6)``), then the row key's 16 bytes, then the ``size`` bytes of the body as the store keeps
it (compressed, with its format prefix: a restore writes it back untouched). A MySQL node builds a block in the
server (:meth:`logstore.backends.mysql.recorder.MySQLRecorder.read_blocks`), so no cell costs the driver a row;
the other backends build it with :func:`encode`.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable
from typing import NamedTuple

from logstore.errors import CorruptBlockError

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_HEAD = re.compile(rb"(\d{1,19}),(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}),(-?\d{1,19}),"
                   rb"([A-Za-z_][A-Za-z0-9_]{0,63}),(\d{1,10}),")
KEY_BYTES = 16


class LogBlock(NamedTuple):
    """Shard ``shard``'s cells in one id range: ``cells`` of them, encoded in ``data``."""

    shard: int
    cells: int
    data: bytes


class BlockCell(NamedTuple):
    """A cell of a block: its coordinates, stored body and creation time (UTC, as a block writes it)."""

    added_id: int
    created: str
    ref_key: int
    column: str
    row_key: bytes
    blob: bytes


def created_text(when: dt.datetime) -> str:
    """``when`` as a block writes a creation time (UTC, microseconds always shown: the texts sort as the times)."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def created_from_micros(micros: int) -> str:
    """A creation time kept as microseconds since the epoch (SQLite's form), as a block writes it."""
    return created_text(_EPOCH + dt.timedelta(microseconds=micros))


def created_time(text: str) -> dt.datetime:
    """A block's creation time as an aware datetime."""
    return dt.datetime.fromisoformat(text + "+00:00")


def encode(cells: Iterable[BlockCell]) -> bytes:
    """The block of ``cells`` (in added_id order), byte for byte what a MySQL node builds of the same cells."""
    parts: list[bytes] = []
    for c in cells:
        parts += [f"{c.added_id},{c.created},{c.ref_key},{c.column},{len(c.blob)},".encode(), c.row_key, c.blob]
    return b"".join(parts)


def decode(data: bytes) -> list[BlockCell]:
    """The cells of a block, each head checked.

    Raises:
        CorruptBlockError: the bytes are not a block (naming the offset where it stops reading as one).
    """
    cells: list[BlockCell] = []
    at, end, match = 0, len(data), _HEAD.match
    while at < end:
        head = match(data, at)
        if head is None:
            raise CorruptBlockError(f"no cell starts at byte {at} of a block of {end}")
        added_id, created, ref_key, column, size = head.groups()
        key_at = head.end()
        body_at = key_at + KEY_BYTES
        at = body_at + int(size)
        if at > end:
            raise CorruptBlockError(f"the cell at byte {head.start()} runs past the block's end")
        cells.append(BlockCell(int(added_id), created.decode(), int(ref_key), column.decode(),
                               data[key_at:body_at], data[body_at:at]))
    return cells
