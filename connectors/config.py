"""A connector's configuration: one YAML file, validated with pydantic (errors name the line and field).

    name: trips-lake                 # its offsets and dead letters live under this name
    columns: [BASE]                  # the columns it loads
    checkpoint_interval: 5           # seconds between checkpoints: flush the sink, then commit
    start_from: beginning
    sink:
      type: parquet
      root: lake                     # relative to the file's directory
      max_rows: 100000

or a PostgreSQL sink (see :mod:`connectors.sinks.postgres`):

    sink:
      type: postgres
      url: postgresql://user:password@127.0.0.1:5432/warehouse
      columns:
        BASE: {mode: latest, promote: [{field: city, type: text}, {field: fare, type: double}]}
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from connectors.errors import SinkConfigError
from connectors.sinks.parquet import ParquetSinkConfig
from connectors.sinks.postgres import PostgresSinkConfig
from indexer.indexes.definitions import DefinitionError, load_yaml
from logstore import InvalidCellError
from logstore.cell import check_column


class ParquetSinkSpec(ParquetSinkConfig):
    type: Literal["parquet"]


class PostgresSinkSpec(PostgresSinkConfig):
    type: Literal["postgres"]


class ConnectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$", description="the connector's offsets and DLQ name")
    columns: list[str] = Field(min_length=1)
    checkpoint_interval: float = Field(5.0, gt=0, description="seconds between flush-then-commit checkpoints")
    start_from: Literal["beginning", "now"] = "beginning"
    brokers: str | None = Field(None, description="host:port,...: read the tailer's Kafka topics (else the logstore)")
    topic_prefix: str = Field("cells", description="with brokers: the tailer's topics are <prefix>.<column>")
    page_size: int = Field(1000, ge=1, le=10_000, description="cells read per shard at a time")
    max_attempts: int = Field(5, ge=1, description="attempts at a batch before it is retried cell by cell")
    sink: ParquetSinkSpec | PostgresSinkSpec = Field(discriminator="type")

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: list[str]) -> list[str]:
        for column in value:
            try:
                check_column(column)
            except InvalidCellError as exc:
                raise ValueError(str(exc)) from None
        if len(set(value)) != len(value):
            raise ValueError("a column is listed twice")
        return value

    @model_validator(mode="after")
    def _tables_for_columns(self) -> ConnectorConfig:
        if isinstance(self.sink, PostgresSinkSpec):
            missing = [c for c in self.columns if c not in self.sink.columns]
            if missing:
                raise ValueError(f"sink: no table for {', '.join(missing)} (sink.columns.<column>: mode, promote)")
        return self


def load_connector(source: str | Path) -> ConnectorConfig:
    """The configuration in a YAML file (a Path) or text (a str). A relative sink root is taken from the
    file's directory. SinkConfigError names the line and field of a problem."""
    try:
        config = load_yaml(source, ConnectorConfig, "<connector>", "a mapping with name, columns and sink")
    except DefinitionError as exc:
        raise SinkConfigError(str(exc)) from None
    if isinstance(source, Path) and isinstance(config.sink, ParquetSinkSpec) and not config.sink.root.is_absolute():
        sink = config.sink.model_copy(update={"root": source.parent / config.sink.root})
        config = config.model_copy(update={"sink": sink})
    return config
