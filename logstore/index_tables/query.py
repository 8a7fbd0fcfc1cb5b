"""Querying an index by name, as a worker node serves it: the catalog read, conditions from JSON values, the query.

The index catalog (written by ``indexer.indexes.catalog``) keeps each index's record in the system cell
``(catalog_row_key(name), "_index", revision)``: its versions, their definitions and states, and the active
one. This module reads that record without the indexer (a worker node sits in logstore, below it) and turns
a query's JSON values into typed :class:`~logstore.index_tables.persistence.Condition`s the way
``indexer.indexes.applier.Index`` does for Python values: the indexer's ``convert`` and ``Index._conditions``
are these functions, so both refuse the same input with the same words.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from pydantic import ValidationError

from logstore.cell import Cell
from logstore.errors import (
    IndexInactiveError,
    IndexUnknownError,
    InvalidArgumentError,
    InvalidConditionError,
    LogstoreError,
)
from logstore.index_tables.persistence import Condition, IndexColumn, IndexEntry, IndexSpec, Order
from logstore.index_tables.store import IndexStore

CATALOG_COLUMN = "_index"
CATALOG_NAMESPACE = uuid.UUID("0b6f6a9e-4f0e-4d0c-9a55-3c1f3e7a2b41")


def catalog_row_key(name: str) -> uuid.UUID:
    """The row of index ``name``'s catalog record."""
    return uuid.uuid5(CATALOG_NAMESPACE, name)


class _Catalogued(Protocol):
    """What reading an index by name needs of a store."""

    @property
    def indexes(self) -> IndexStore: ...

    def get_cell_latest(self, row_key: uuid.UUID | str, column: str) -> Cell | None: ...


# -- values -----------------------------------------------------------------------------------
def convert_value(f: IndexColumn, value: Any) -> Any:
    """A JSON value as the typed value of field ``f``.

    Raises:
        ValueError: it does not fit, saying what was expected and what came (the indexer wraps it as an
            ``EntryFieldError``, a query as an :class:`InvalidConditionError`).
    """
    def wrong(expected: str) -> ValueError:
        return ValueError(f"expected {expected}, got {type(value).__name__} {value!r:.60}")

    if f.type == "uuid":
        if not isinstance(value, str):
            raise wrong("a UUID string")
        try:
            return uuid.UUID(value)
        except ValueError:
            raise wrong("a UUID string") from None
    if f.type == "str":
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if f.type == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        if not -(2**63) <= value < 2**63:
            raise wrong("an integer within 64 bits")
        return value
    if f.type == "float":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise wrong("a finite number")
        return float(value)
    if f.type == "bool":
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if f.type == "datetime":
        return _datetime(value, wrong)
    return value  # json: any JSON value, stored as it is


def _datetime(value: Any, wrong: Callable[[str], ValueError]) -> dt.datetime:
    """ISO-8601 with a zone, or seconds since the epoch; always returned in UTC."""
    if isinstance(value, bool):
        raise wrong("an ISO-8601 time with a zone, or epoch seconds")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise wrong("an ISO-8601 time with a zone, or epoch seconds")
        try:
            return dt.datetime.fromtimestamp(value, dt.UTC)
        except (OverflowError, OSError, ValueError):
            raise wrong("epoch seconds in range") from None
    if isinstance(value, str):
        try:
            when = dt.datetime.fromisoformat(value)
        except ValueError:
            raise wrong("an ISO-8601 time with a zone") from None
        if when.tzinfo is None:
            raise wrong("an ISO-8601 time with a zone (this one has none)")
        try:
            return when.astimezone(dt.UTC)
        except OverflowError:  # 0001-01-01T00:00:00+01:00 is before year 1 in UTC: not a time that can be stored
            raise wrong("a time within years 1 to 9999 in UTC") from None
    raise wrong("an ISO-8601 time with a zone, or epoch seconds")


def conditions(spec: IndexSpec, name: str, fields: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """The conditions of a query of index ``name`` (version ``spec``): ``key=value`` is equality, ``key=(start,
    end)`` (a tuple or a list) a range, start included, end excluded, None for an open end. Values are JSON
    values, or the typed ones (a ``uuid.UUID``, an aware ``datetime``).

    Returns:
        (field, operator, typed value) of each condition, for :class:`~logstore.index_tables.persistence.Condition`.

    Raises:
        InvalidConditionError: a key that is not a query key, a range that is not (start, end), a value of
            the wrong type.
    """
    out: list[tuple[str, str, Any]] = []
    for key, given in fields.items():
        if key not in spec.keys:
            problem = f"not a query key (keys: {', '.join(spec.keys)})"
            raise InvalidConditionError(f"index {name}: {key!r} is {problem}", key, problem)
        column = spec.field(key)
        if isinstance(given, tuple | list):
            if len(given) != 2:
                raise InvalidConditionError(f"index {name}: {key} range must be (start, end)", key,
                                            "a range is [start, end] (null for an open end)")
            start, end = given
            if start is not None:
                out.append((key, ">=", _value(name, column, start)))
            if end is not None:
                out.append((key, "<", _value(name, column, end)))
        else:
            out.append((key, "=", _value(name, column, given)))
    return out


def _value(name: str, column: IndexColumn, value: Any) -> Any:
    if column.type == "uuid" and isinstance(value, uuid.UUID):
        return value
    if column.type == "datetime" and isinstance(value, dt.datetime):
        if value.utcoffset() is None:
            raise InvalidConditionError(f"index {name}: {column.name} needs a time with a zone", column.name,
                                        "needs a time with a zone")
        return value  # stored as microseconds since the epoch, whatever its zone
    try:
        return convert_value(column, value)
    except ValueError as exc:
        raise InvalidConditionError(f"index {name}: {column.name}: {exc}", column.name, str(exc)) from None


# -- the catalog, read ------------------------------------------------------------------------
class IndexVersionInfo(NamedTuple):
    version: int
    state: str  # building, ready, active, retired (dropped versions are left out)
    column: str  # the source column
    spec: IndexSpec


class IndexInfo(NamedTuple):
    """An index as its catalog record has it."""

    name: str
    active: int | None
    versions: list[IndexVersionInfo]

    def version(self, version: int | None = None) -> IndexVersionInfo:
        """``version``, or the active version: its state, source column and spec.

        Raises:
            IndexUnknownError: no such version (or a dropped one).
            IndexInactiveError: no version named and none active.
        """
        wanted = self.active if version is None else version
        if wanted is None:
            states = ", ".join(f"{v.version} {v.state}" for v in self.versions) or "none"
            raise IndexInactiveError(f"index {self.name} has no active version yet (versions: {states}); "
                                     "backfill one and activate it, or name a version")
        for found in self.versions:
            if found.version == wanted:
                return found
        known = ", ".join(str(v.version) for v in self.versions) or "none"
        raise IndexUnknownError(f"index {self.name} has no version {wanted} (versions: {known})")

    def spec(self, version: int | None = None) -> IndexSpec:
        """The spec of ``version``, or of the active version (raises as :meth:`version`)."""
        return self.version(version).spec

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "active": self.active, "versions": [
            {"version": v.version, "state": v.state, "column": v.column, "shard_field": v.spec.shard_field,
             "keys": list(v.spec.keys), "fields": [f.model_dump() for f in v.spec.fields]} for v in self.versions]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> IndexInfo:
        """The inverse of :meth:`to_json` (what ``GET /v1/indexes`` lists)."""
        name = str(doc["name"])
        versions = [IndexVersionInfo(int(v["version"]), str(v["state"]), str(v["column"]), IndexSpec(
            name=name, version=int(v["version"]), shard_field=str(v["shard_field"]),
            fields=[IndexColumn.model_validate(f) for f in v["fields"]])) for v in doc["versions"]]
        active = doc.get("active")
        return cls(name, int(active) if active is not None else None, versions)


def entry_from_json(spec: IndexSpec, doc: Mapping[str, Any]) -> IndexEntry:
    """The inverse of :meth:`IndexEntry.to_json <logstore.index_tables.persistence.IndexEntry.to_json>`: the
    fields typed as ``spec`` declares them (a null stays None)."""
    fields = {f.name: None if doc.get(f.name) is None else convert_value(f, doc[f.name])
              for f in spec.fields if f.name in doc}
    return IndexEntry(int(doc["shard"]), uuid.UUID(doc["row_key"]), int(doc["ref_key"]), fields)


def json_condition(value: Any) -> Any:
    """A condition's value as JSON carries it: a range as a list, a UUID as text, a time in ISO-8601."""
    if isinstance(value, tuple | list):
        return [json_condition(v) for v in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return value


def index_info(store: _Catalogued, name: str) -> IndexInfo:
    """Index ``name`` as the catalog has it now.

    Raises:
        IndexUnknownError: no index of that name.
        LogstoreError: the store's, reading the record.
    """
    cell = store.get_cell_latest(catalog_row_key(name), CATALOG_COLUMN)
    if cell is None:
        raise IndexUnknownError(f"no index named {name!r} (an app registers it with app.index(...))")
    body = cell.body
    versions = []
    try:
        for number, record in sorted(((int(v), r) for v, r in dict(body.get("versions") or {}).items())):
            if record.get("state") == "dropped":
                continue
            definition = dict(record["definition"])
            column = str(definition.pop("column"))
            versions.append(IndexVersionInfo(number, str(record.get("state")), column,
                                             IndexSpec.model_validate(definition)))
        active = body.get("active")
        return IndexInfo(name, int(active) if active is not None else None, versions)
    except (KeyError, TypeError, ValueError, ValidationError) as exc:
        raise IndexUnknownError(f"index {name}: its catalog record cannot be read ({exc})") from None


def index_names(store: _Catalogued) -> list[str]:
    """The names of the indexes whose tables the storage nodes hold."""
    return sorted({spec.name for spec in store.indexes.specs()})


def query_index(store: _Catalogued, name: str, where: Mapping[str, Any], *, order: Order = "asc", limit: int = 100,
                scatter: bool = False, version: int | None = None) -> tuple[IndexSpec, list[IndexEntry]]:
    """Entries of index ``name`` (its active version, or ``version``) matching ``where`` (see :func:`conditions`),
    as ``indexer.indexes.applier.Index.query`` gives them, with the version read.

    Raises:
        IndexUnknownError: no such index or version.
        IndexInactiveError: no version named and none active.
        InvalidConditionError: a bad condition.
        InvalidArgumentError: a query naming no shard field without ``scatter``, a bad order or limit.
    """
    spec = index_info(store, name).spec(version)
    given = conditions(spec, name, where)
    if not scatter and not any(field == spec.shard_field and op == "=" for field, op, _ in given):
        problem = f"a query without {spec.shard_field} reads every shard; ask for it with scatter"
        raise InvalidConditionError(f"index {name}: {problem}", "scatter", problem)
    try:
        return spec, store.indexes.query(spec, [Condition(*c) for c in given], order=order, limit=limit,
                                         scatter=scatter)
    except LogstoreError as exc:
        if exc.retriable or isinstance(exc, InvalidArgumentError):
            raise
        # The version may have been switched and dropped since the catalog was read: read it again (as Index).
        fresh = index_info(store, name).spec(version)
        if fresh == spec:
            raise
        return fresh, store.indexes.query(fresh, [Condition(*c) for c in conditions(fresh, name, where)],
                                          order=order, limit=limit, scatter=scatter)
