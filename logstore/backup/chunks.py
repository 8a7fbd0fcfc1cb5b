"""The bytes of a backup's files: MessagePack compressed with zlib, a cell as a 7-item array.

A cell is ``[shard, added_id, row_key (16 bytes), column, ref_key, body (its MessagePack form), created_at
(microseconds since the epoch, UTC)]``: what a restore needs to store it again with the same id and time.
"""

from __future__ import annotations

import datetime as dt
import re
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack

from logstore.cell import PackedCell
from logstore.errors import CorruptBackupError

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # logstore.cell.check_column's, reserved ones included
# Level 1: cell files (bodies repeating their field names) come out about as small as at level 6, much
# faster (docs/benchmarks.md, "Backup and restore").
_LEVEL = 1


def micros(when: dt.datetime) -> int:
    return (when - _EPOCH) // dt.timedelta(microseconds=1)


def pack(value: Any) -> bytes:
    """``value`` (MessagePack's types) as a file's bytes."""
    return zlib.compress(msgpack.packb(value, use_bin_type=True), _LEVEL)


def unpack(name: str, data: bytes) -> Any:
    """A file's value.

    Raises:
        CorruptBackupError: the bytes do not inflate or do not parse (naming ``name``).
    """
    try:
        return msgpack.unpackb(zlib.decompress(data), raw=False, strict_map_key=False)
    except (zlib.error, ValueError, msgpack.UnpackException) as exc:
        raise CorruptBackupError(name, f"cannot be read ({exc})") from None


def pack_cells(cells: Sequence[PackedCell]) -> bytes:
    """A cell file of ``cells`` (in shard, then added_id order)."""
    return pack([[c.shard, c.added_id, c.row_key.bytes, c.column, c.ref_key, c.packed, micros(c.created_at)]
                 for c in cells])


def unpack_rows(name: str, data: bytes) -> list[list[Any]]:
    """The cells of a cell file as its arrays, each checked for the types of its 7 items (a column as cells
    name theirs), so that a restore that verified a file turns every row into a cell without failing.

    Raises:
        CorruptBackupError: it does not read as a cell file.
    """
    rows = unpack(name, data)
    if type(rows) is not list:
        raise CorruptBackupError(name, "is not a cell file")
    columns: set[str] = set()
    for row in rows:
        if not (type(row) is list and len(row) == 7 and type(row[0]) is int and type(row[1]) is int
                and type(row[2]) is bytes and len(row[2]) == 16 and type(row[3]) is str and type(row[4]) is int
                and type(row[5]) is bytes and type(row[6]) is int):
            raise CorruptBackupError(name, f"holds a cell that is not one: {str(row)[:100]}")
        columns.add(row[3])
    for column in columns:
        if not _COLUMN.fullmatch(column):
            raise CorruptBackupError(name, f"holds a cell of column {column[:80]!r}, not a column name")
    return rows
