"""The cell: its record type, validation, the stored body format and the shard hash.

Stored body format (version 1): one format-version byte ``0x01`` followed by the
zlib stream of the body's MessagePack form. Bodies are validated as JSON values
before packing, so what comes back is what a JSON round trip would give. Reading
trusts none of it: a body is inflated within a byte cap, and one that decodes to
what JSON cannot hold is a CorruptCellError of its cell alone (:func:`decode_body`).

Shard of a row: the first 8 bytes of ``BLAKE2b(row_key.bytes, digest_size=8)`` read
as a big-endian unsigned integer, modulo the shard count. BLAKE2b mixes all 16
bytes, so time-ordered UUIDs (v1, v6, v7) spread as evenly as random ones, and the
value never depends on the Python version or process (unlike ``hash()``).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import itertools
import math
import re
import uuid
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack
import orjson

from logstore.errors import CorruptCellError, InvalidCellError

FORMAT_V1 = 1
_V1_PREFIX = bytes([FORMAT_V1])
REF_KEY_LIMIT = 1 << 63
COLUMN_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_DEPTH = 64
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1
#: The default limit on a body's MessagePack form (StoreOptions.max_body_bytes), and the least a reader inflates.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Deflate writes at most this many bytes out per byte in (zlib's FAQ: 1032:1), so a stream of n bytes cannot
# inflate past n * _MOST_INFLATED: one under the cap that way is inflated whole, in one call.
_MOST_INFLATED = 1032
# Bytes as _nonfinite_possible looks at them: 1 a float's marker, 2 the first byte of a NaN or an infinity.
_FLOAT_HEADS = bytes(1 if b in (0xCA, 0xCB) else 2 if b in (0x7F, 0xFF) else 0 for b in range(256))


class Cell(NamedTuple):
    """An immutable stored cell. ``body`` is a fresh dict on every read."""

    row_key: uuid.UUID
    column: str
    ref_key: int
    body: dict[str, Any]
    added_id: int
    shard: int
    created_at: dt.datetime

    def coordinates(self) -> dict[str, Any]:
        """The cell without its body, JSON-ready: what names it in errors and dead letters.

        Returns:
            ``row_key`` (a string), ``column``, ``ref_key``, ``added_id``, ``shard`` and ``created_at`` (ISO 8601).
        """
        return _coordinates(self)

    def to_json(self) -> dict[str, Any]:
        """The cell as a JSON-ready dict (the wire and CLI form): its :meth:`coordinates` and its ``body``."""
        return {**_coordinates(self), "body": self.body}


class PackedCell(NamedTuple):
    """A stored cell with its body left as stored MessagePack (decompressed, never decoded): for readers
    that pass bodies on as MessagePack, such as the tailer's ``msgpack`` messages. ``body`` decodes it."""

    row_key: uuid.UUID
    column: str
    ref_key: int
    packed: bytes  # the body's MessagePack form (a map)
    added_id: int
    shard: int
    created_at: dt.datetime

    @property
    def body(self) -> dict[str, Any]:
        """The body, decoded on each access. Raises CorruptCellError for a map that is not a JSON object."""
        return unpack_map(self.packed)

    def coordinates(self) -> dict[str, Any]:
        """The cell without its body, as :meth:`Cell.coordinates` gives it (the body is not decoded)."""
        return _coordinates(self)

    def to_cell(self) -> Cell:
        return Cell(self.row_key, self.column, self.ref_key, self.body, self.added_id, self.shard, self.created_at)


#: What a log read gives: a cell, or one whose body stayed packed.
AnyCell = Cell | PackedCell


def _coordinates(cell: AnyCell) -> dict[str, Any]:
    return {
        "row_key": str(cell.row_key), "column": cell.column, "ref_key": cell.ref_key,
        "added_id": cell.added_id, "shard": cell.shard, "created_at": cell.created_at.isoformat(),
    }


TOMBSTONE_FIELD = "_deleted"  # a body with this field true is a tombstone: its row is deleted in that column


def is_tombstone(body: Mapping[str, Any]) -> bool:
    """Whether a cell's body is a tombstone (``{"_deleted": true, ...}``, as a migrated row's deletion is): its row
    has no value in that column from that version on. Secondary indexes drop the row's entry; the PostgreSQL
    sink's ``latest`` tables delete its row; a cell's log keeps it as any other cell."""
    return body.get(TOMBSTONE_FIELD) is True


def shard_of(row_key: uuid.UUID, shard_count: int) -> int:
    return shard_of_bytes(row_key.bytes, shard_count)


def shard_of_bytes(row_key: bytes, shard_count: int) -> int:
    """:func:`shard_of` of a row key given as its 16 bytes (for searches that try many keys)."""
    digest = hashlib.blake2b(row_key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % shard_count


def coerce_row_key(value: object) -> uuid.UUID:
    if type(value) is uuid.UUID:
        return value
    if isinstance(value, uuid.UUID):
        return uuid.UUID(bytes=value.bytes)
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            raise InvalidCellError("row_key", f"{value!r} is not a UUID") from None
    raise InvalidCellError("row_key", f"expected a UUID, got {type(value).__name__}")


def check_column(column: object, *, allow_reserved: bool = False) -> str:
    if not isinstance(column, str) or not COLUMN_RE.fullmatch(column):
        raise InvalidCellError(
            "column", f"{column!r} must match ^[A-Za-z_][A-Za-z0-9_]{{0,63}}$"
        )
    if column[0] == "_" and not allow_reserved:
        raise InvalidCellError(
            "column", f"{column!r} starts with '_', which is reserved for cellstream's own data"
        )
    return column


def check_ref_key(ref_key: object) -> int:
    if type(ref_key) is not int:
        raise InvalidCellError("ref_key", f"expected an integer, got {type(ref_key).__name__}")
    if not 0 <= ref_key < REF_KEY_LIMIT:
        raise InvalidCellError("ref_key", f"{ref_key} is outside [0, 2^63)")
    return ref_key


class _BadValue(Exception):
    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.path: list[str | int] = []


def _check_value(value: Any, depth: int) -> None:
    """Raise _BadValue unless ``value`` is JSON: the leaves of a container are checked in its own loop,
    not by a call each (the calls were most of a put's validation)."""
    t = type(value)
    if t is dict or t is list:
        _check_container(value, depth)
    elif not _scalar(value, t):
        raise _BadValue(f"{t.__name__} is not a JSON type (str, int, float, bool, None, list, dict)")


def _scalar(value: Any, t: type) -> bool:
    """True for a JSON scalar; raises _BadValue for an int or float JSON cannot hold; False otherwise."""
    if t is str or t is bool or value is None:
        return True
    if t is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise _BadValue(f"integer {value} does not fit in 64 bits")
        return True
    if t is float:
        if not math.isfinite(value):
            raise _BadValue(f"{value} is not a JSON number (NaN and Infinity are refused)")
        return True
    return False


def _check_container(value: dict[Any, Any] | list[Any], depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise _BadValue(f"nested deeper than {MAX_DEPTH} levels")
    is_dict = type(value) is dict
    for key, item in value.items() if is_dict else enumerate(value):  # type: ignore[union-attr]
        if is_dict and type(key) is not str:
            raise _BadValue(f"key {key!r} is not a string")
        t = type(item)
        if t is str or t is bool or (t is float and math.isfinite(item)):
            continue  # the common leaves, checked inline
        try:
            if t is dict or t is list:
                _check_container(item, depth + 1)
            elif not _scalar(item, t):
                raise _BadValue(f"{t.__name__} is not a JSON type (str, int, float, bool, None, list, dict)")
        except _BadValue as bad:
            bad.path.append(key)
            raise


def _field(path: list[str | int]) -> str:
    out = "body"
    for part in reversed(path):
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def pack_body(body: object, max_bytes: int) -> bytes:
    """Validate ``body`` as a JSON object and return its MessagePack form."""
    if type(body) is not dict:
        raise InvalidCellError("body", f"expected a dict (JSON object), got {type(body).__name__}")
    try:
        _check_value(body, 0)
    except _BadValue as bad:
        raise InvalidCellError(_field(bad.path), bad.problem) from None
    try:
        packed: bytes = msgpack.packb(body, use_bin_type=True)
    except UnicodeEncodeError:
        raise InvalidCellError("body", "contains a string that is not valid UTF-8") from None
    if len(packed) > max_bytes:
        raise InvalidCellError(
            "body", f"MessagePack form is {len(packed)} bytes, over the {max_bytes}-byte limit"
        )
    return packed


def compress(packed: bytes, level: int) -> bytes:
    return _V1_PREFIX + zlib.compress(packed, level)


def decode_body(blob: bytes, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, Any]:
    """A stored body, decoded (:func:`unpack_map` of it inflated).

    Args:
        blob: the stored bytes (format version 1).
        max_bytes: the most bytes its MessagePack form may inflate to; a body is never written over the
            store's ``max_body_bytes``, so more is damage, and inflating stops there.

    Returns:
        The body: a dict of JSON values only.

    Raises:
        CorruptCellError: an unknown format, a stream that does not inflate within ``max_bytes``, or
            MessagePack that is not a map of JSON values (bin, ext or timestamp types, a key not a string,
            NaN or an infinity, nesting past 254 levels).
    """
    return unpack_map(inflate_body(blob, max_bytes))


def unpack_map(packed: bytes) -> dict[str, Any]:
    """A body's MessagePack form, decoded: a dict of JSON values only.

    What JSON has no type for, MessagePack refuses itself: bin of any length but 0, every ext type
    (timestamps included), keys other than strings and bin. What is left (an empty bin as a value or a key,
    NaN or an infinity, deep nesting) orjson finds at a fraction of a walk's cost: it refuses bytes and what
    nests past 254 levels, and writes NaN and the infinities as ``null``; so only a body with a ``null`` in it
    that may hold such a float is walked (:func:`_nonfinite_possible`).

    Raises:
        CorruptCellError: it is not a map of JSON values.
    """
    try:
        body = msgpack.unpackb(packed, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0,
                               ext_hook=_no_ext)
    except (ValueError, msgpack.UnpackException) as exc:
        text = str(exc)
        if "max_bin_len" in text:
            text = "it holds MessagePack bin (bytes), not a JSON type"
        elif "max_ext_len" in text:
            text = "it holds a MessagePack ext type (such as a timestamp), not a JSON type"
        raise CorruptCellError(f"cell body cannot be decoded: {text}") from None
    if type(body) is not dict:
        raise CorruptCellError("cell body is not a MessagePack map")
    try:
        if orjson.dumps(body).find(b"null") >= 0 and _nonfinite_possible(packed):
            _refuse(body, None)
    except TypeError:  # orjson.JSONEncodeError is one
        _refuse(body, "it is not JSON")
    return body


def unpack_body(blob: bytes, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The MessagePack of a stored body, inflated within ``max_bytes`` (as :func:`decode_body`) and not decoded.
    zlib's checksum finds damage to the stored bytes; what the map holds is not seen until it is decoded
    (:func:`unpack_map`): a reader that passes it on as MessagePack never makes JSON of it.

    Raises:
        CorruptCellError: an unknown format, a stream that does not inflate within ``max_bytes``, or bytes
            that do not start a MessagePack map.
    """
    packed = inflate_body(blob, max_bytes)
    if not packed or not (0x80 <= packed[0] <= 0x8F or packed[0] in (0xDE, 0xDF)):  # fixmap, map 16, map 32
        raise CorruptCellError("cell body is not a MessagePack map")
    return packed


def inflate_body(blob: bytes, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The MessagePack form of a stored body, inflated no further than ``max_bytes`` (see :func:`decode_body`).

    Raises:
        CorruptCellError: an unknown format, or a zlib stream that is damaged or inflates past ``max_bytes``.
    """
    if not blob or blob[0] != FORMAT_V1:
        raise CorruptCellError(f"unknown cell body format version {blob[0] if blob else None!r}")
    try:
        if len(blob) * _MOST_INFLATED <= max_bytes:  # cannot inflate past the cap: one call, the cheapest way
            return zlib.decompress(blob[1:])
        inflater = zlib.decompressobj()
        packed = inflater.decompress(blob[1:], max_bytes + 1)
    except zlib.error as exc:
        raise CorruptCellError(f"cell body cannot be decoded: {exc}") from None
    if len(packed) > max_bytes:
        raise CorruptCellError(f"cell body inflates past {max_bytes} bytes, more than a body is written with")
    if not inflater.eof:
        raise CorruptCellError("cell body cannot be decoded: incomplete or truncated stream")
    return packed


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"MessagePack ext type {code} is not a JSON type")


def _nonfinite_possible(packed: bytes) -> bool:
    """Whether ``packed`` may hold NaN or an infinity: a float marker (0xca, 0xcb) followed by 0x7f or 0xff,
    the sign and the top of an exponent of all ones (rare finite floats and other bytes match too)."""
    return packed.translate(_FLOAT_HEADS).find(b"\x01\x02") >= 0


def _refuse(body: dict[str, Any], problem: str | None) -> None:
    """Raise CorruptCellError naming what in ``body`` is not JSON; without ``problem``, only if something is."""
    try:
        _check_value(body, 0)
    except _BadValue as bad:
        # The path quoted: its keys are stored data, which must not break a log line.
        raise CorruptCellError(f"cell body is not JSON at {_field(bad.path)!r}: {bad.problem}") from None
    if problem is not None:
        raise CorruptCellError(f"cell body cannot be decoded: {problem}")


def same_json(a: Any, b: Any) -> bool:
    """Equality that tells JSON types apart (1, 1.0 and True are three values)."""
    ta = type(a)
    if ta is not type(b):
        return False
    if ta is dict:
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if ta is list:
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@functools.lru_cache(maxsize=1024)
def key_in_shard(namespace: uuid.UUID, base: str, shard: int, shard_count: int) -> uuid.UUID:
    """The first of ``uuid5(namespace, f"{base}\\0{n}")``, n = 0, 1, ..., that falls in ``shard``: about
    ``shard_count`` tries. Computed as uuid5 does (SHA-1 of the namespace and the name, version and variant
    bits set) with the hash of the common prefix taken once: the same ids, for less CPU per search. The
    dead-letter store and the job records keep all their rows in one shard this way. The last searches are
    remembered: an app's start asks for its policy's key twice, each search milliseconds at 4096 shards.
    """
    prefix = hashlib.sha1(namespace.bytes + f"{base}\x00".encode(), usedforsecurity=False)
    for n in itertools.count():
        digest = prefix.copy()
        digest.update(str(n).encode())
        raw = bytearray(digest.digest()[:16])
        raw[6] = (raw[6] & 0x0F) | 0x50  # version 5
        raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
        key = bytes(raw)
        if shard_of_bytes(key, shard_count) == shard:
            return uuid.UUID(bytes=key)
    raise AssertionError("unreachable")
