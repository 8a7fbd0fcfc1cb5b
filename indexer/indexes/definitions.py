"""Secondary index definitions: the YAML file (docs/indexes.md has an example), its validation, and turning a
cell's body into an entry.

An index copies the declared fields of every cell of its source column into an entry that lives in the shard of
its ``shard_field`` (denormalized, so a query that names the shard field reads one shard). ``key`` fields can be
queried on; the shard field is always one. A bad file is a :class:`~logstore.errors.ConfigFileError` naming the
line and the field; a cell whose body lacks a declared field, or has it with the wrong type, is an
:class:`EntryFieldError` (non-retriable: the runtime dead-letters the cell with the reason).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from indexer.errors import EntryFieldError
from logstore import InvalidCellError
from logstore.cell import check_column
from logstore.configfile import load_yaml
from logstore.index_tables.persistence import MAX_KEY_CHARS, IndexColumn, IndexSpec
from logstore.index_tables.query import convert_value

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
    """A JSON value as the typed value of field ``f``; EntryFieldError when it does not fit (the rules are
    logstore's, :func:`logstore.index_tables.query.convert_value`: a worker node's queries read the same)."""
    try:
        return convert_value(f, value)
    except ValueError as exc:
        raise EntryFieldError(index, f.name, str(exc)) from None


# -- loading, with the line of every error ---------------------------------------------
def load_indexes(source: str | Path) -> list[IndexDefinition]:
    """The index definitions in a YAML file (a Path) or YAML text (a str); a bad one is a ConfigFileError naming
    the line and the field (see :func:`logstore.configfile.load_yaml`)."""
    return list(load_yaml(source, IndexFile, "<indexes>", "a mapping with an 'indexes' list").indexes)
