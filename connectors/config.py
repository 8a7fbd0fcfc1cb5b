"""A connector's configuration: one YAML file, validated with pydantic (errors name the line and field).

    name: trips-lake                 # its offsets and dead letters live under this name
    columns: [BASE]                  # the columns it loads
    checkpoint_interval: 5           # seconds between checkpoints: flush the sink, then commit
    start_from: beginning
    sink:
      type: parquet
      root: lake                     # relative to the file's directory
      max_rows: 100000
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from indexer.definitions import DefinitionError, load_yaml
from logstore import InvalidCellError
from logstore.cell import check_column

from .errors import SinkConfigError
from .parquet import ParquetSinkConfig


class ParquetSinkSpec(ParquetSinkConfig):
    type: Literal["parquet"]


class ConnectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$", description="the connector's offsets and DLQ name")
    columns: list[str] = Field(min_length=1)
    checkpoint_interval: float = Field(5.0, gt=0, description="seconds between flush-then-commit checkpoints")
    start_from: Literal["beginning", "now"] = "beginning"
    page_size: int = Field(1000, ge=1, le=10_000, description="cells read per shard at a time")
    max_attempts: int = Field(5, ge=1, description="attempts at a batch before it is retried cell by cell")
    sink: ParquetSinkSpec

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


def load_connector(source: str | Path) -> ConnectorConfig:
    """The configuration in a YAML file (a Path) or text (a str). A relative sink root is taken from the
    file's directory. SinkConfigError names the line and field of a problem."""
    try:
        config = load_yaml(source, ConnectorConfig, "<connector>", "a mapping with name, columns and sink")
    except DefinitionError as exc:
        raise SinkConfigError(str(exc)) from None
    if isinstance(source, Path) and not config.sink.root.is_absolute():
        sink = config.sink.model_copy(update={"root": source.parent / config.sink.root})
        config = config.model_copy(update={"sink": sink})
    return config
