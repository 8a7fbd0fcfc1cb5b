"""A migration's declaration: one YAML file, validated with pydantic (errors name the line and field).

    name: trips                        # the migration's state lives under this name
    source:
      url: postgresql://user:password@10.0.0.5:5432/app   # or mysql://... (a MySQL/MariaDB server)
      table: trips
      # replicas: [mysql://user:password@10.0.0.7:3306/app]   # MySQL: replicas whose lag holds the copy
    row_key:
      column: trip_uuid                # a UUID column of the table, or:
      # uuid5: 6ba7b811-9dad-11d1-80b4-00c04fd430c8   # uuid5(namespace, "trips:" + the primary key)
    columns:                           # each cell column: the source columns its body holds
      BASE: [rider_id, driver_id, fare, status]
      ROUTE: [pickup, dropoff]
    ref_key: log_position              # or {column: updated_at}: a version column, in microseconds

``ref_key: log_position`` (the default) versions each cell by the source's log position (a PostgreSQL LSN, a
binlog position): the copy and the change stream then merge with no lock and no window, the latest cell of a
row being its newest state. A version column works as well when every write advances it.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from logstore import InvalidCellError
from logstore.cell import check_column
from logstore.configfile import load_yaml

_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_$]{0,63}$"  # a table or column name a migration quotes and reads


class SourceSpec(BaseModel):
    """The table a migration moves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: SecretStr = Field(description="postgresql://user:password@host:port/database or mysql://... (never printed)")
    table: str = Field(pattern=_IDENTIFIER)
    schema_name: str | None = Field(None, alias="schema", pattern=_IDENTIFIER,
                                    description="PostgreSQL's schema (public); MySQL's database is the URL's")
    replicas: list[SecretStr] = Field(default_factory=list, description="MySQL/MariaDB replicas whose lag holds "
                                      "the copy (gh-ost's --throttle-control-replicas): mysql:// URLs, never "
                                      "printed; PostgreSQL reports its standbys' lag itself")

    @model_validator(mode="after")
    def _replicas_of_mysql(self) -> SourceSpec:
        if self.replicas and self.kind != "mysql":
            raise ValueError("replicas: PostgreSQL reports its standbys' lag itself; replicas are for a MySQL source")
        for replica in self.replicas:
            if url_kind(replica.get_secret_value()) != "mysql":
                raise ValueError("replicas: each is a mysql:// URL")
        return self

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: SecretStr) -> SecretStr:
        if url_kind(url.get_secret_value()) is None:
            raise ValueError("a source is a postgresql:// or mysql:// URL")
        return url

    @property
    def describe(self) -> str:
        """The source as a migration record names it, never with its URL: ``postgres:public.trips``."""
        return f"{self.kind}:{self.schema_name + '.' if self.schema_name else ''}{self.table}"

    @property
    def kind(self) -> Literal["postgres", "mysql"]:
        kind = url_kind(self.url.get_secret_value())
        assert kind is not None  # checked when the spec was read
        return kind


def url_kind(url: str) -> Literal["postgres", "mysql"] | None:
    """Which kind of server a source URL names, or None for another scheme."""
    scheme = urlsplit(url).scheme
    if scheme in ("postgresql", "postgres"):
        return "postgres"
    if scheme in ("mysql", "mariadb"):
        return "mysql"
    return None


class RowKeySpec(BaseModel):
    """Where a row's key comes from: a UUID column, or a uuid5 of the table and the primary key (a legacy
    integer id maps to one key, the same on both sides, forever)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    column: str | None = Field(None, pattern=_IDENTIFIER)
    uuid5: str | None = Field(None, description="the namespace UUID of uuid5(namespace, '<table>:<key>')")

    @model_validator(mode="after")
    def _one_way(self) -> RowKeySpec:
        if (self.column is None) == (self.uuid5 is None):
            raise ValueError("give row_key either a column (a UUID column) or uuid5 (a namespace UUID)")
        if self.uuid5 is not None:
            try:
                uuid.UUID(self.uuid5)
            except ValueError:
                raise ValueError(f"row_key.uuid5 must be a UUID, got {self.uuid5!r}") from None
        return self


class VersionColumn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    column: str = Field(pattern=_IDENTIFIER, description="a column every write advances (a timestamp or a number)")


class MigrationSpec(BaseModel):
    """A migration of one table into cells."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,62}$")
    source: SourceSpec
    row_key: RowKeySpec
    columns: dict[str, list[str]] = Field(min_length=1, description="cell column -> the source columns of its body")
    ref_key: Literal["log_position"] | VersionColumn = "log_position"

    @field_validator("columns")
    @classmethod
    def _columns(cls, columns: dict[str, list[str]]) -> dict[str, list[str]]:
        for column, fields in columns.items():
            try:
                check_column(column)
            except InvalidCellError as exc:
                raise ValueError(f"columns: {exc.problem}") from None
            if not fields:
                raise ValueError(f"columns.{column} names no source column")
            for name in fields:
                if not isinstance(name, str) or not name or len(name) > 64:
                    raise ValueError(f"columns.{column}: {name!r} is not a column name")
        return columns

    @property
    def source_columns(self) -> list[str]:
        """Every source column the cells hold, each once, in the order the spec names them."""
        return list(dict.fromkeys(name for fields in self.columns.values() for name in fields))


def load_migration(source: str | Path) -> MigrationSpec:
    """A migration's declaration from its YAML file (a Path) or YAML text (a str).

    Raises:
        ConfigFileError: the file cannot be read, is not valid YAML, or does not validate (the first problem,
            with its line and field).
    """
    return load_yaml(source, MigrationSpec, "<migration>", "a mapping with name, source, row_key and columns")
