"""The Kafka message of a cell, and of a dead-lettered cell.

Cell message on topic ``<prefix>.<column>``, partition ``shard mod P``:

- key: the row_key as text (``str(UUID)``), so a row's cells stay on one partition;
- headers (UTF-8 text): ``shard``, ``added_id``, ``column``, ``ref_key``, ``created_at``
  (ISO-8601, UTC) and ``content-type`` (``application/json`` or ``application/msgpack``);
- value: the cell as an object with ``row_key``, ``column``, ``ref_key``, ``added_id``,
  ``shard``, ``created_at`` and ``body``, in JSON (default) or MessagePack. In MessagePack the
  body is the stored MessagePack as it is (the store keeps bodies so, compressed).

Dead-letter message on ``<prefix>-deadletter``: the same key and headers plus
``error``; the value is a JSON object naming the cell (coordinates, no body),
the topic it was meant for, the error and the tailer that gave up on it.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any, Literal, NamedTuple

import msgpack
import orjson
from pydantic_core import PydanticSerializationError, to_json

from logstore import Cell
from logstore.cell import AnyCell, PackedCell

Headers = list[tuple[str, bytes]]
CONTENT_TYPES = {"json": b"application/json", "msgpack": b"application/msgpack"}
_BODY_KEY = msgpack.packb("body")
_MAP_OF_SIX, _MAP_OF_SEVEN = 0x86, b"\x87"  # MessagePack fixmap headers


class Message(NamedTuple):
    key: bytes
    value: bytes
    headers: Headers


def _headers(where: dict[str, Any]) -> Headers:
    return [(name, str(where[name]).encode()) for name in ("shard", "added_id", "column", "ref_key", "created_at")]


def _json(record: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON, the bytes of pydantic-core's ``to_json``.

    orjson first: it takes a third of the time, and writes the same bytes for every JSON value but NaN and
    Infinity, which it writes as ``null``. So its output stands only when it holds no ``null``; else, and
    for what orjson refuses (an integer over 64 bits, a key not a string), pydantic-core decides. That one
    writes NaN/Infinity as bare constants: when those bytes appear at all, json.dumps decides (it refuses a
    real NaN with ValueError and accepts the word inside a string)."""
    try:
        value = orjson.dumps(record)
    except TypeError:
        pass
    else:
        if b"null" not in value:
            return value
    try:
        value = to_json(record)
    except PydanticSerializationError as exc:
        raise ValueError(str(exc)) from None
    if b"NaN" in value or b"Infinity" in value:
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return value


# UTC created_at times rendered, as text and bytes: a transaction's cells share their time, so the pages of
# many shards need the times of a few batches, each many times, and isoformat() per cell is costly. Only UTC
# times (the store's): for them equal times are equal texts. Cleared when full.
_rendered: dict[dt.datetime, tuple[str, bytes]] = {}
_RENDERED_KEPT = 4096
_new_tuple = tuple.__new__  # Message(...) goes through a Python-level __new__, a cost per cell


def encode_cell(cell: AnyCell, value_format: Literal["json", "msgpack"] = "json") -> Message:
    """The message for ``cell``. Raises TypeError/ValueError if the body cannot be encoded. A PackedCell's
    body goes into a MessagePack value as it is: the bytes are those of packing the decoded cell."""
    row_key = str(cell.row_key)
    time = cell.created_at
    known = _rendered.get(time) if time.tzinfo is dt.UTC else None
    if known is not None:
        created_at, created_bytes = known
    else:
        created_at = time.isoformat()
        created_bytes = created_at.encode()
        if time.tzinfo is dt.UTC:
            if len(_rendered) >= _RENDERED_KEPT:
                _rendered.clear()
            _rendered[time] = (created_at, created_bytes)
    shard, added_id, ref_key = str(cell.shard), str(cell.added_id), str(cell.ref_key)
    if value_format == "json":
        # Only the body needs a serializer: the other fields are a UUID, a column name ([A-Za-z0-9_]), integers
        # and an ISO time, which JSON takes as they are. The bytes are those of serializing the whole record.
        value = (f'{{"row_key":"{row_key}","column":"{cell.column}","ref_key":{ref_key},"added_id":{added_id},'
                 f'"shard":{shard},"created_at":"{created_at}","body":').encode() + _json(cell.body) + b"}"
    else:
        record = {"row_key": row_key, "column": cell.column, "ref_key": cell.ref_key, "added_id": cell.added_id,
                  "shard": cell.shard, "created_at": created_at}
        if isinstance(cell, PackedCell):
            head = msgpack.packb(record, use_bin_type=True)
            assert head[0] == _MAP_OF_SIX
            value = _MAP_OF_SEVEN + head[1:] + _BODY_KEY + cell.packed  # the same map with "body" last
        else:
            record["body"] = cell.body
            value = msgpack.packb(record, use_bin_type=True)
    headers = [("shard", shard.encode()), ("added_id", added_id.encode()), ("column", cell.column.encode()),
               ("ref_key", ref_key.encode()), ("created_at", created_bytes),
               ("content-type", CONTENT_TYPES[value_format])]
    message: Message = _new_tuple(Message, (row_key.encode(), value, headers))
    return message


def deadletter_record(
    where: dict[str, Any], *, topic: str, error: BaseException, stage: str, tailer: str, worker: str
) -> dict[str, Any]:
    """The tailer's dead-letter record of the cell at ``where`` (its coordinates), meant for ``topic`` (the
    destination its cells go to), which failed at ``stage`` (``decode``, ``encode`` or ``publish``)."""
    return {
        "cell": where,
        "topic": topic,
        "stage": stage,
        "error": {"type": type(error).__name__, "message": str(error)},
        "tailer": tailer,
        "worker": worker,
        "failed_at": dt.datetime.now(dt.UTC).isoformat(),
    }


def deadletter_message(record: dict[str, Any]) -> Message:
    """The message of a dead-letter record on the ``<prefix>-deadletter`` topic."""
    where = record["cell"]
    headers = [*_headers(where), ("error", str(record["error"]["type"]).encode()),
               ("content-type", CONTENT_TYPES["json"])]
    return Message(str(where["row_key"]).encode(), json.dumps(record, default=str).encode(), headers)


def encode_deadletter(
    where: dict[str, Any], *, topic: str, error: BaseException, stage: str, tailer: str, worker: str
) -> Message:
    """The dead-letter message for the cell at ``where`` (its coordinates)."""
    return deadletter_message(deadletter_record(where, topic=topic, error=error, stage=stage, tailer=tailer,
                                                worker=worker))


def _loads(value: bytes) -> Any:
    """JSON as the standard library reads it, by orjson where it can (a fifth of the time): what orjson refuses
    and json accepts (an integer over 64 bits, a lone surrogate escape) goes to json."""
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return json.loads(value)


def decode_cell(value: bytes, headers: Headers | None = None) -> Cell:
    """The cell a message carries (for consumers); the format comes from ``content-type``."""
    kind = dict(headers or []).get("content-type", CONTENT_TYPES["json"])
    return _cell(msgpack.unpackb(value, raw=False) if kind == CONTENT_TYPES["msgpack"] else _loads(value))


def decode_cell_value(value: bytes) -> Cell:
    """The cell a message carries, its format told by the value's first byte: ``{`` opens a JSON object, and
    anything else is read as MessagePack (whose maps start with 0x80-0x8f, 0xde or 0xdf). The ``content-type``
    header of every message the tailer writes agrees; reading no header saves a consumer building them."""
    return _cell(_loads(value) if value[:1] == b"{" else msgpack.unpackb(value, raw=False))


# created_at texts parsed: the cells of a transaction share their time (as _rendered above). Cleared when full.
_parsed: dict[str, dt.datetime] = {}


def _cell(record: dict[str, Any]) -> Cell:
    """The Cell of a decoded message value (KeyError, TypeError or ValueError when it is not one)."""
    created_at = record["created_at"]
    time = _parsed.get(created_at)
    if time is None:
        time = dt.datetime.fromisoformat(created_at)
        if len(_parsed) >= _RENDERED_KEPT:
            _parsed.clear()
        _parsed[created_at] = time
    cell: Cell = _new_tuple(Cell, (uuid.UUID(record["row_key"]), record["column"], record["ref_key"], record["body"],
                                   record["added_id"], record["shard"], time))
    return cell

