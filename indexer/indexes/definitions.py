"""Secondary index definitions: the YAML file, its validation, and turning a cell's body into an entry.

>>> [index] = load_indexes('''
... indexes:
...   - name: driver_partner_index
...     column: BASE
...     version: 1
...     shard_field: driver_partner_uuid
...     fields:
...       - {name: driver_partner_uuid, type: uuid, key: true}
...       - {name: city_uuid, type: uuid, key: true}
...       - {name: trip_created_at, type: datetime, key: true}
...       - {name: fare, type: float}
... ''')
>>> index.keys
('driver_partner_uuid', 'city_uuid', 'trip_created_at')

An index copies the declared fields of every cell of its source column into an
entry that lives in the shard of its ``shard_field`` (denormalized, so a query that
names the shard field reads one shard). ``key`` fields can be queried on; the shard
field is always one. A bad file is a :class:`DefinitionError` naming the line and the
field; a cell whose body lacks a declared field, or has it with the wrong type, is an
:class:`EntryFieldError` (non-retriable: the runtime dead-letters the cell with the reason).
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import uuid
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from indexer.errors import DefinitionError, EntryFieldError
from logstore import InvalidCellError
from logstore.cell import check_column
from logstore.index_tables.persistence import MAX_KEY_CHARS, IndexColumn, IndexSpec

IndexField = IndexColumn  # one body field copied into the entries (name, type, key)


class IndexDefinition(IndexSpec):
    """One index version: entries from the cells of ``column``, in the shard of ``shard_field``."""

    column: str = Field(description="the source column; every cell written to it updates the index")

    @field_validator("column")
    @classmethod
    def _column(cls, value: str) -> str:
        try:
            return check_column(value)
        except InvalidCellError as exc:
            raise ValueError(str(exc)) from None

    @functools.cached_property
    def spec(self) -> IndexSpec:
        """What the storage nodes hold (the definition without its source column)."""
        return IndexSpec.model_validate(self.model_dump(exclude={"column"}))

    def entry(self, body: dict[str, Any]) -> dict[str, Any]:
        """The typed values of every declared field of ``body``; EntryFieldError names the first bad one."""
        out: dict[str, Any] = {}
        keys = self.keys
        for f in self.fields:
            if f.name not in body:
                raise EntryFieldError(self.name, f.name, "missing from the cell's body")
            value = body[f.name]
            if value is None:
                if f.name in keys:
                    raise EntryFieldError(self.name, f.name, "is null, and a query key must have a value")
                out[f.name] = None
                continue
            out[f.name] = convert(self.name, f, value)
            if f.type == "str" and f.name in keys and len(value) > MAX_KEY_CHARS:
                raise EntryFieldError(self.name, f.name, f"is longer than {MAX_KEY_CHARS} characters, the limit of "
                                                         "a query key")
        return out


class IndexFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    indexes: list[IndexDefinition] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> IndexFile:
        versions = [f"{i.name} version {i.version}" for i in self.indexes]
        twice = sorted({v for v in versions if versions.count(v) > 1})
        if twice:
            raise ValueError(f"indexes: {', '.join(twice)} defined more than once")
        columns: dict[str, str] = {}
        for index in self.indexes:
            if columns.setdefault(index.name, index.column) != index.column:
                raise ValueError(f"indexes: the versions of {index.name} read different columns "
                                 f"({columns[index.name]}, {index.column}); an index has one source column")
        return self


def convert(index: str, f: IndexField, value: Any) -> Any:
    """A JSON value as the typed value of field ``f``; EntryFieldError when it does not fit."""
    def wrong(expected: str) -> EntryFieldError:
        return EntryFieldError(index, f.name, f"expected {expected}, got {type(value).__name__} {value!r:.60}")

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


def _datetime(value: Any, wrong: Any) -> dt.datetime:
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
        return when.astimezone(dt.UTC)
    raise wrong("an ISO-8601 time with a zone, or epoch seconds")


# -- loading, with the line of every error ---------------------------------------------
def load_indexes(source: str | Path) -> list[IndexDefinition]:
    """The index definitions in a YAML file (a Path) or YAML text (a str)."""
    return list(load_yaml(source, IndexFile, "<indexes>", "a mapping with an 'indexes' list").indexes)


M = TypeVar("M", bound=BaseModel)


def load_yaml(source: str | Path, model: type[M], label: str, shape: str) -> M:
    """A pydantic model from a YAML file (a Path) or text (a str, called ``label`` in errors); a
    DefinitionError names the line and the dotted field of the first problem (list items by their name)."""
    if isinstance(source, Path):
        name = str(source)
        try:
            text = source.read_text()
        except OSError as exc:
            raise DefinitionError(name, None, "", f"cannot read it: {exc.strerror or exc}") from None
    else:
        name, text = label, source
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise DefinitionError(name, mark.line + 1 if mark else None, "", f"not valid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise DefinitionError(name, None, "", f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise DefinitionError(name, 1, "", f"the file must be {shape}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        line, field, message = _locate(root, tuple(error["loc"]), error["msg"].removeprefix("Value error, "))
        raise DefinitionError(name, line, field, message) from None


def _locate(root: yaml.Node | None, loc: tuple[Any, ...], message: str) -> tuple[int | None, str, str]:
    """The line and the dotted field of a validation error, list items named by their ``name``."""
    node, path, parts = root, list[str](), list(loc)
    while parts and _tag(node) == parts[0]:  # a tagged union's member, named by the mapping's own type
        parts.pop(0)
    while parts and (child := _child(node, parts[0])) is not None:
        part, node = parts.pop(0), child
        named = _child(child, "name") if isinstance(part, int) else None
        if isinstance(part, int) and path:
            path[-1] += f"[{named.value if isinstance(named, yaml.ScalarNode) else part}]"
        else:
            path.append(str(part))
        while parts and _tag(node) == parts[0]:
            parts.pop(0)
    line = node.start_mark.line + 1 if node is not None else None
    # A check across fields says which one it is about first ("shard_field: ..."): point at that key.
    head, sep, rest = message.partition(": ")
    key = _key(node, head) if sep and not parts else None
    if key is not None:
        line, message = key.start_mark.line + 1, rest
        path.append(head)
    path.extend(str(p) for p in parts)  # a missing field: named, on the line of what should hold it
    return line, ".".join(path), message


def _tag(node: yaml.Node | None) -> str | None:
    """The ``type`` of a mapping node (what a tagged union's error location names it by)."""
    found = _entry(node, "type")
    return str(found[1].value) if found is not None and isinstance(found[1], yaml.ScalarNode) else None


def _entry(node: yaml.Node | None, name: Any) -> tuple[yaml.Node, yaml.Node] | None:
    """The (key, value) nodes of ``name`` in a mapping node."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == name:
                return key, value
    return None


def _key(node: yaml.Node | None, name: str) -> yaml.Node | None:
    found = _entry(node, name)
    return found[0] if found else None


def _child(node: yaml.Node | None, part: Any) -> yaml.Node | None:
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        child: yaml.Node = node.value[part]
        return child
    found = _entry(node, part)
    return found[1] if found else None
