"""The worker node's wire format, shared by the server (:mod:`logstore.node.server`) and the client
(:mod:`logstore.backends.http`): cells and errors as JSON. (What requests may hold: :mod:`logstore.node.models`.)

A cell travels as :meth:`Cell.to_json` gives it. A mark of the cell counts (:meth:`Store.changed_counts`)
travels as an opaque token (:func:`encode_mark`), which the node that made it takes back. An error travels as
``{"error": {"type", "message", "retriable", "field"?, "coordinates"?, "cells_before"?}}``
with the HTTP status of its kind (:data:`STATUS`), so the client raises the same
:class:`~logstore.errors.LogstoreError` a local store would.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import uuid
from typing import Any

from logstore.cell import Cell
from logstore.errors import (
    AuthenticationError,
    CellConflictError,
    ConfigurationError,
    CorruptCellError,
    IndexInactiveError,
    IndexUnknownError,
    InvalidArgumentError,
    InvalidCellError,
    InvalidConditionError,
    LogstoreError,
    StorageError,
    StorageUnavailableError,
)
from logstore.store import CountsMark

# The status of each error kind; the first match in this order wins (subclasses first).
STATUS: list[tuple[type[LogstoreError], int]] = [
    (InvalidArgumentError, 400),
    (CellConflictError, 409),
    (StorageUnavailableError, 503),
    (ConfigurationError, 500),
    (CorruptCellError, 500),
    (StorageError, 500),
    (LogstoreError, 500),
]


# -- cells ------------------------------------------------------------------------------
def cell_from_json(doc: dict[str, Any]) -> Cell:
    return Cell(uuid.UUID(doc["row_key"]), doc["column"], int(doc["ref_key"]), doc["body"], int(doc["added_id"]),
                int(doc["shard"]), dt.datetime.fromisoformat(doc["created_at"]))


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(raw: bytes) -> Any:
    """Strict JSON: NaN and Infinity are refused (a stored body must be JSON again when read)."""
    return json.loads(raw, parse_constant=_no_constant)


# -- marks of the cell counts ---------------------------------------------------------------
def encode_mark(mark: object, instance: str) -> str:
    """A token for the mark a store gave: the serving process's ``instance`` and the mark, as base64url JSON."""
    return base64.urlsafe_b64encode(dumps([instance, mark])).rstrip(b"=").decode()


def decode_mark(token: str, instance: str) -> CountsMark | None:
    """The mark in a token of :func:`encode_mark`, or None for a token this process did not make: another
    process's (the node restarted; its marks mean nothing here) or not a mark at all. None asks the store
    for every shard's count, which is never wrong, so a client that sends a bad token is not refused."""
    try:
        doc = loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (ValueError, RecursionError):  # binascii.Error and UnicodeDecodeError are ValueErrors
        return None
    if not (isinstance(doc, list) and len(doc) == 2 and doc[0] == instance):
        return None
    mark = doc[1]
    if not (isinstance(mark, list) and len(mark) == 2 and type(mark[0]) is int and isinstance(mark[1], dict)):
        return None
    # A node's mark is a value or a flat tuple (the recorders'): an array becomes a tuple again.
    return CountsMark(mark[0], {name: tuple(value) if isinstance(value, list) else value
                                for name, value in mark[1].items()})


# -- errors -----------------------------------------------------------------------------
_BATCH_FIELD = re.compile(r"cells\.([0-9]+)\.(.+)", re.DOTALL)
_CELL_FIELD = re.compile(r"(?:cells\.[0-9]+\.)?(?:row_key|column|ref_key|body)(?:[.\[].*)?", re.DOTALL)


def error_status(exc: LogstoreError) -> int:
    return next(status for kind, status in STATUS if isinstance(exc, kind))


def error_json(exc: LogstoreError) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc), "retriable": exc.retriable}
    if isinstance(exc, InvalidCellError):  # a batch's cell is named as the request named it: cells.N.<field>
        doc["field"] = exc.field if exc.index is None else f"cells.{exc.index}.{exc.field}"
        doc["problem"] = exc.problem
    if isinstance(exc, CellConflictError):
        doc["coordinates"] = {"row_key": str(exc.row_key), "column": exc.column, "ref_key": exc.ref_key}
    if isinstance(exc, CorruptCellError):
        doc["problem"] = exc.problem
        doc["coordinates"] = {"shard": exc.shard, "added_id": exc.added_id, "column": exc.column,
                              "ref_key": exc.ref_key,
                              "row_key": str(exc.row_key) if exc.row_key is not None else None,
                              "created_at": exc.created_at.isoformat() if exc.created_at is not None else None}
        doc["cells_before"] = [c.to_json() for c in exc.cells_before]
    return {"error": doc}


def error(kind: str, message: str, retriable: bool = False) -> dict[str, Any]:
    """The error document of an answer that is not a LogstoreError (not found, a timeout, the HTTP layer's)."""
    return {"error": {"type": kind, "message": message, "retriable": retriable}}


def bad_request(field: str, problem: str, kind: str | None = None) -> dict[str, Any]:
    """A request the server refuses before it reaches the store (the field is named as sent). A cell's
    coordinates or body are an InvalidCellError, as the store would have raised; ``kind`` names another."""
    kind = kind or ("InvalidCellError" if _CELL_FIELD.fullmatch(field) else "InvalidArgumentError")
    doc = error(kind, f"{field}: {problem}")
    doc["error"].update(field=field, problem=problem)
    return doc


def error_from_json(status: int, doc: Any) -> LogstoreError:
    """The LogstoreError a response carries (a local store would have raised the same)."""
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict):
        return StorageError(f"worker node answered HTTP {status} without an error document")
    kind, message = str(error.get("type")), str(error.get("message"))
    if kind == "InvalidCellError" and "field" in error:
        field, problem = str(error["field"]), str(error.get("problem", message))
        batch = _BATCH_FIELD.fullmatch(field)
        if batch:
            return InvalidCellError(batch[2], problem, index=int(batch[1]))
        return InvalidCellError(field, problem)
    if kind == "InvalidConditionError" and "field" in error:  # an index query's: where.<key>, or scatter
        return InvalidConditionError(message, str(error["field"]).removeprefix("where."),
                                     str(error.get("problem", message)))
    if status == 400:
        return InvalidArgumentError(message)
    if kind == "IndexUnknownError":
        return IndexUnknownError(message)
    if kind == "IndexInactiveError":
        return IndexInactiveError(message)
    if kind == "CellConflictError":
        where = error.get("coordinates") or {}
        return CellConflictError(where.get("row_key"), str(where.get("column")), int(where.get("ref_key", -1)))
    if kind == "CorruptCellError":
        where = dict(error.get("coordinates") or {})
        if where.get("row_key") is not None:
            where["row_key"] = uuid.UUID(where["row_key"])
        if where.get("created_at") is not None:
            where["created_at"] = dt.datetime.fromisoformat(where["created_at"])
        named = where if where.get("shard") is not None else None
        corrupt = CorruptCellError(str(error.get("problem", message)), named)
        corrupt.cells_before = [cell_from_json(c) for c in error.get("cells_before") or []]
        return corrupt
    if status == 503 or error.get("retriable"):
        return StorageUnavailableError(f"worker node: {message}")
    if status in (401, 403, 429):
        return AuthenticationError(f"worker node refused the request: {message}")
    if kind == "ConfigurationError":
        return ConfigurationError(f"worker node: {message}")
    return StorageError(f"worker node answered HTTP {status}: {message}")
