"""The bytes of a backup's files.

A cell file is its log blocks (:mod:`logstore.log_blocks`) one after another, each framed by a 16-byte header
``>IIQ``: shard, cells, bytes. The bodies in a block are the stored ones, already compressed: the file is not
compressed again, and a restore writes them back as they are. The state file is MessagePack compressed with
zlib.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack

from logstore.errors import CorruptBackupError, CorruptBlockError
from logstore.log_blocks import BlockCell, LogBlock, decode

_FRAME = struct.Struct(">IIQ")
_LEVEL = 1  # the state file is small: fast beats small


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


def cell_file(blocks: Sequence[LogBlock]) -> bytes:
    """A cell file of ``blocks`` (in shard, then added_id order; the empty ones left out)."""
    parts: list[bytes] = []
    for b in blocks:
        if b.cells:
            parts += [_FRAME.pack(b.shard, b.cells, len(b.data)), b.data]
    return b"".join(parts)


def frames(name: str, data: bytes) -> list[tuple[int, int, memoryview]]:
    """The (shard, cells, block bytes) of each block of a cell file, read from their headers only.

    Raises:
        CorruptBackupError: a header runs past the file's end.
    """
    out: list[tuple[int, int, memoryview]] = []
    view, at, end = memoryview(data), 0, len(data)
    while at < end:
        if at + _FRAME.size > end:
            raise CorruptBackupError(name, f"ends inside the header of a block at byte {at}")
        shard, cells, size = _FRAME.unpack_from(data, at)
        at += _FRAME.size
        if at + size > end:
            raise CorruptBackupError(name, f"the block of shard {shard} at byte {at} runs past the file's end")
        out.append((shard, cells, view[at:at + size]))
        at += size
    return out


def count_cells(name: str, data: bytes) -> int:
    """The cells a cell file says it holds (its headers'). Raises CorruptBackupError as :func:`frames`."""
    return sum(cells for _, cells, _ in frames(name, data))


def read_cell_file(name: str, data: bytes) -> list[tuple[int, list[BlockCell]]]:
    """Each block of a cell file as its shard and cells, every cell read and each block's count checked, so
    that a restore that verified a file writes every cell of it without failing.

    Raises:
        CorruptBackupError: it does not read as a cell file (naming the shard where it stops).
    """
    out: list[tuple[int, list[BlockCell]]] = []
    for shard, count, block in frames(name, data):
        try:
            cells = decode(bytes(block))
        except CorruptBlockError as exc:
            raise CorruptBackupError(name, f"the block of shard {shard}: {exc}") from None
        if len(cells) != count:
            raise CorruptBackupError(name, f"the block of shard {shard} holds {len(cells)} cells, its header "
                                     f"says {count}")
        out.append((shard, cells))
    return out
