"""What the worker node accepts, as pydantic models: path parameters, query strings and request bodies.

One source: the server validates every request with these models and the OpenAPI document
(:mod:`logstore.node.openapi`) is their JSON Schema, so a request the document allows is one the server
takes (schemathesis checks both ways). The models depend on the node's shard count (a shard number is
0 to count-1, in a path, a query or a body's keys), so :func:`models` builds them per count.

Stricter than a local store where HTTP needs it: integers in a path or a query are ASCII ``0|[1-9][0-9]*``
(``int()`` would take ``+7``, ``1_000`` and other scripts' digits); numbers in a body lie in MessagePack's
range, ``[-2**63, 2**64)`` (a local store takes a larger float); consumer and owner names are
``[A-Za-z0-9_.:@-]``; the columns a client writes do not start with ``_`` (cellstream's own, written only
through the admin route).
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, create_model
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from logstore.index_tables.store import MAX_QUERY_LIMIT

MAX_LOCATION = (1 << 63) - 1
NUMBER_MIN, NUMBER_MAX = -(1 << 63), (1 << 64) - 1  # MessagePack's integers
UUID_PATTERN = r"^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"
COLUMN_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"  # reads: cellstream's own columns too
USER_COLUMN_PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,63}$"  # writes through the token's routes
NAME_PATTERN = r"^[A-Za-z0-9_.:@-]{1,200}$"  # consumers and owners
MARK_PATTERN = r"^[A-Za-z0-9_-]{1,4000}$"  # a mark of the cell counts, base64url (logstore.node.wire)
MAX_BATCH = 10_000
INDEX_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,47}$"  # an index's name (logstore.index_tables.persistence.IndexSpec)
MAX_READ_BATCH = 1000  # coordinates of a batched read (POST /v1/cells/read)
MAX_PAGE = 100_000
_DIGITS = re.compile(r"0|[1-9][0-9]{0,18}")


# -- integers -------------------------------------------------------------------------------
def _text_int(value: object) -> object:
    """A path or query integer: ASCII digits, no sign, no leading zero."""
    if not isinstance(value, str):
        return value
    if not _DIGITS.fullmatch(value):
        raise PydanticCustomError("ascii_integer", "{text} is not an integer in ASCII digits (0|[1-9][0-9]*)",
                                  {"text": repr(value)})
    return int(value)


def _json_int(value: object) -> object:
    """A JSON integer: JSON has one number type, so 5.0 is the integer 5 (and JSON Schema says so too)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# Constraints go before the validator: after it, pydantic would write them into the JSON Schema as "ge"/"le".
TextInt = Annotated[int, BeforeValidator(_text_int)]
JsonInt = Annotated[int, BeforeValidator(_json_int)]
Location = Annotated[int, Field(ge=0, le=MAX_LOCATION), BeforeValidator(_json_int)]
_RFC3339 = re.compile(r"([0-9]{4}-[0-9]{2}-[0-9]{2})[Tt]([0-9]{2}:[0-9]{2}):([0-9]{2})(\.[0-9]+)?"
                      r"([Zz]|[+-][0-9]{2}:[0-9]{2})")


def _date_time(value: object) -> dt.datetime:
    """An RFC 3339 date-time (JSON Schema's "date-time": a UTC offset required; a leap second is the instant
    after the second before it), in UTC. pydantic's own datetime would take a number of seconds too."""
    found = _RFC3339.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        raise PydanticCustomError("date_time", "{text} is not an RFC 3339 time with a UTC offset "
                                  "(e.g. 2026-11-24T10:00:00Z)", {"text": repr(value)})
    day, minutes, seconds, fraction, offset = found.groups()
    leap = seconds == "60"
    text = f"{day}T{minutes}:{'59' if leap else seconds}{(fraction or '')[:7]}{'+00:00' if offset in 'Zz' else offset}"
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise PydanticCustomError("date_time", "{text} is not a valid time: {problem}",
                                  {"text": repr(value), "problem": str(exc)}) from None
    try:
        return (when + dt.timedelta(seconds=1) if leap else when).astimezone(dt.UTC)
    except OverflowError:  # beyond year 1 or 9999 in UTC: before, or after, every cell
        return (dt.datetime.min if when.year == 1 else dt.datetime.max).replace(tzinfo=dt.UTC)


DateTime = Annotated[dt.datetime, BeforeValidator(_date_time),
                     WithJsonSchema({"type": "string", "format": "date-time"})]


def integer_pattern(count: int) -> str:
    """A regular expression matching exactly the decimal numbers 0 to ``count - 1`` (keys of a JSON object)."""
    top = count - 1
    parts = []
    for digits in range(1, len(str(top)) + 1):
        low = 0 if digits == 1 else 10 ** (digits - 1)
        parts += _span(str(low), str(min(top, 10 ** digits - 1)))
    return "^(" + "|".join(parts) + ")$"


def _span(low: str, high: str) -> list[str]:
    """Patterns for the numbers from ``low`` to ``high``, both of the same number of digits."""
    if low == high:
        return [low]
    rest = len(low) - 1
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return [f"[{low[0]}-{high[0]}]" + "[0-9]" * rest]
    if low[0] == high[0]:
        return [low[0] + p for p in _span(low[1:], high[1:])]
    out = [low[0] + p for p in _span(low[1:], "9" * rest)]
    if int(low[0]) + 1 <= int(high[0]) - 1:
        out.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}]" + "[0-9]" * rest)
    return out + [high[0] + p for p in _span("0" * rest, high[1:])]


# -- bodies ---------------------------------------------------------------------------------
# pydantic resolves every "$ref" of a schema it is given against its own definitions, so the models' schemas
# name the recursive JsonValue by this marker and the OpenAPI document puts the "$ref" in its place.
JSON_VALUE = {"x-cellstream-schema": "JsonValue"}
SCHEMAS: dict[str, Any] = {"JsonValue": {"anyOf": [  # shared definitions the models' schemas refer to
    {"type": "null"}, {"type": "boolean"}, {"type": "string"},
    {"type": "number", "minimum": NUMBER_MIN, "maximum": NUMBER_MAX},
    {"type": "array", "items": JSON_VALUE}, {"type": "object", "additionalProperties": JSON_VALUE},
]}}


def _numbers_in_range(value: object) -> object:
    """Refuse a number outside MessagePack's range, naming where it is (the store checks the rest of a
    cell's body; an offset's doc is stored as JSON, and is held to the same range)."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif isinstance(item, int | float) and not isinstance(item, bool) and \
                not (math.isfinite(item) and NUMBER_MIN <= item <= NUMBER_MAX):
            raise PydanticCustomError("number_range", "{where}: {number} is outside [-2**63, 2**64)",
                                      {"where": where or "body", "number": item})
    return value


Body = Annotated[dict[str, Any], BeforeValidator(_numbers_in_range),
                 WithJsonSchema({"type": "object", "additionalProperties": JSON_VALUE,
                                 "description": "a JSON object; numbers in [-2**63, 2**64)"})]


_SCALAR = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]


def _condition(value: object) -> object:
    """An index query's condition: a value (equality), or [start, end] (a range; null for an open end)."""
    scalar = (str, int, float)  # bool is an int
    if isinstance(value, scalar) or (isinstance(value, list) and len(value) == 2 and
                                     all(v is None or isinstance(v, scalar) for v in value)):
        return value
    raise PydanticCustomError("condition", "a condition is a value (equality) or [start, end] (a range, start "
                                           "included, end excluded, null for an open end), not {text}",
                              {"text": repr(value)[:60]})


Condition = Annotated[Any, BeforeValidator(_condition), WithJsonSchema({"anyOf": [
    *_SCALAR, {"type": "array", "minItems": 2, "maxItems": 2, "items": {"anyOf": [*_SCALAR, {"type": "null"}]}}]})]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- the models of one shard count ------------------------------------------------------------
class Models:
    """Every request model of a node with ``shard_count`` shards (build with :func:`models`)."""

    def __init__(self, shard_count: int) -> None:
        self.shard_count = shard_count
        def shard() -> Any:
            return Field(ge=0, le=shard_count - 1)

        shard_item = Annotated[int, shard(), BeforeValidator(_json_int)]
        shard_key = Annotated[str, Field(pattern=integer_pattern(shard_count))]
        keyed: JsonDict = {"additionalProperties": False}
        column = Annotated[str, Field(pattern=COLUMN_PATTERN)]
        user_column = Annotated[str, Field(pattern=USER_COLUMN_PATTERN)]
        name = Annotated[str, Field(pattern=NAME_PATTERN)]
        row_key = Annotated[str, Field(pattern=UUID_PATTERN, description="the row's UUID")]
        columns = Annotated[str, Field(pattern="^{0}(,{0})*$".format(COLUMN_PATTERN.strip("^$")),
                                       description="comma-separated column names")]

        def model(model_name: str, /, **fields: Any) -> type[BaseModel]:
            return create_model(model_name, __base__=Strict, **fields)

        # paths
        self.Shard = model("ShardPath", shard=(TextInt, shard()))
        self.Row = model("RowPath", row_key=(row_key, ...))
        self.RowColumn = model("RowColumnPath", row_key=(row_key, ...), column=(column, ...))
        self.CellAt = model("CellPath", row_key=(row_key, ...), column=(column, ...),
                            ref_key=(TextInt, Field(ge=0, le=MAX_LOCATION)))
        self.CellWrite = model("CellWritePath", row_key=(row_key, ...), column=(user_column, ...),
                               ref_key=(TextInt, Field(ge=0, le=MAX_LOCATION)))
        self.Consumer = model("ConsumerPath", consumer=(name, ...))
        # query strings
        after = (TextInt, Field(0, ge=0, le=MAX_LOCATION, description="location to read after (default 0)"))
        self.LogQuery = model("LogQuery", after=after,
                              limit=(TextInt, Field(1000, ge=1, le=MAX_PAGE, description="cells at most")),
                              columns=(columns | None, None))
        self.CountQuery = model("CountQuery", after=after, columns=(columns | None, None), reserved=(
            Literal["true", "false"], Field("true", description="false: cellstream's own columns (starting with "
                                                                "_) are not counted")))
        self.CountsQuery = model("CountsQuery", since=(Annotated[str, Field(pattern=MARK_PATTERN)] | None, Field(
            None, description="the mark of an earlier answer of this node (opaque)")))
        self.LocationQuery = model("LocationQuery", at=(DateTime, Field(
            description="an ISO 8601 time with a UTC offset, e.g. 2026-11-24T10:00:00Z")))
        as_of = (DateTime | None, Field(None, description="an RFC 3339 time with a UTC offset: the newest version "
                                                          "(highest ref_key) among those created at or before it"))
        self.AsOfQuery = model("AsOfQuery", as_of=as_of)
        self.VersionsQuery = model(
            "VersionsQuery", before=(Annotated[int, Field(ge=0, le=MAX_LOCATION), BeforeValidator(_text_int)] | None,
                                     Field(None, description=(
                "only versions with a lower ref_key: the `next` of the previous page (default: from the highest)"))),
            limit=(TextInt, Field(100, ge=1, le=MAX_PAGE, description="versions at most (default 100)")))
        # bodies
        cell = model("CellIn", row_key=(row_key, ...), column=(user_column, ...), ref_key=(Location, ...),
                     body=(Body, ...))
        system_cell = model("SystemCellIn", row_key=(row_key, ...), column=(column, ...), ref_key=(Location, ...),
                            body=(Body, ...))
        batch = Field(min_length=1, max_length=MAX_BATCH)
        self.PutCells = model("PutCells", cells=(list[cell], batch))  # type: ignore[valid-type]
        self.PutSystemCells = model("PutSystemCells", cells=(list[system_cell], batch))  # type: ignore[valid-type]
        wanted = model("CellWanted", row_key=(row_key, ...), column=(column, ...), ref_key=(Location | None, Field(
            None, description="the version; without it (or null) the latest, as of `as_of` when given")))
        self.ReadCells = model("ReadCells", cells=(list[wanted], Field(  # type: ignore[valid-type]
            min_length=1, max_length=MAX_READ_BATCH)), as_of=as_of, max_bytes=(
                Annotated[int, Field(ge=1, le=MAX_LOCATION), BeforeValidator(_json_int)] | None, Field(
                    None, description="the bodies the answer may bring (their MessagePack bytes), below the node's "
                                      "own budget (default: that budget)")))
        self.CellBody = Body
        # secondary indexes
        self.IndexPath = model("IndexPath", name=(Annotated[str, Field(pattern=INDEX_NAME_PATTERN)], ...))
        self.IndexQuery = model(
            "IndexQuery",
            where=(dict[str, Condition], Field(default_factory=dict, description=(
                "query key -> a value (equality) or [start, end] (a range, start included, end excluded, null for "
                "an open end), as the index's field types take them in a cell's body"))),
            order=(Literal["asc", "desc"], Field("asc", description="by the keys after the shard field, then row_key")),
            limit=(JsonInt, Field(100, ge=1, le=MAX_QUERY_LIMIT, description="entries at most")),
            scatter=(bool, Field(False, description="required without an equality on the shard field: reads every "
                                                    "shard")),
            version=(Annotated[int, Field(ge=1, le=9999), BeforeValidator(_json_int)] | None, Field(
                None, description="the version to read (default: the active one)")))
        self.LogsQuery = model(
            "LogsQuery", locations=(dict[shard_key, Location], Field(
                min_length=1, json_schema_extra=keyed, description="shard (as a string) -> location to read after")),
            limit=(JsonInt, Field(1000, ge=1, le=MAX_PAGE)), columns=(list[column] | None, None))
        self.ClaimOffsets = model("ClaimOffsets", owner=(name, ...),
                                  shards=(list[shard_item] | None, None))
        offset = model("OffsetIn", location=(Location, ...), doc=(Body, Field(default_factory=dict)))
        self.CommitOffsets = model("CommitOffsets", owner=(name, ...), offsets=(
            dict[shard_key, offset],  # type: ignore[valid-type]
            Field(json_schema_extra=keyed, description="shard (as a string) -> position")))

@functools.lru_cache(maxsize=8)
def models(shard_count: int) -> Models:
    return Models(shard_count)
