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
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from indexer.runtime.redrive import RedrivePolicy
from logstore import InvalidCellError
from logstore.cell import check_column
from logstore.configfile import load_yaml
from logstore.net import mask_userinfo
from tailer.security import PLAINTEXT, KafkaSecurity, load_kafka_config

_NAME = r"^[a-z_][a-z0-9_]{0,62}$"  # a PostgreSQL identifier cellstream creates
PromotedType = Literal["text", "bigint", "double", "boolean", "timestamptz", "uuid", "jsonb"]


class ParquetSinkConfig(BaseModel):
    """Where the lake is and when a file is rotated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path
    max_rows: int = Field(100_000, ge=1, description="rows in one file at most")
    max_bytes: int = Field(64 << 20, ge=1024, description="about this many bytes of row data in one file")
    max_seconds: float = Field(300.0, gt=0, description="a file is written at most this long after its first row")
    compression: Literal["zstd", "snappy", "gzip", "none"] = "zstd"


class Promoted(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str = Field(min_length=1, description="the body field (nested ones as a.b)")
    column: str | None = Field(None, pattern=_NAME, description="the table column; default: the field, a.b as a_b")
    type: PromotedType

    @property
    def name(self) -> str:
        return self.column or self.field.replace(".", "_").lower()


class TableSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["history", "latest"]
    table: str | None = Field(None, pattern=_NAME, description="default: cells_<column in lower case>")
    promote: list[Promoted] = Field(default_factory=list)


def table_name(column: str, spec: TableSpec) -> str:
    """The PostgreSQL table a column loads into."""
    return spec.table or f"cells_{column.lower()}"


class PostgresSinkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: SecretStr = Field(description="postgresql://user:password@host:port/database, with libpq's parameters "
                                       "(?sslmode=verify-full&sslrootcert=...&sslcert=...&sslkey=...)")
    db_schema: str = Field("public", alias="schema", pattern=_NAME)
    columns: dict[str, TableSpec] = Field(min_length=1, description="how each column is loaded")

    @field_validator("url")
    @classmethod
    def _libpq_url(cls, url: SecretStr) -> SecretStr:
        """What libpq would refuse at the first connection (an unknown parameter, a bad sslmode), refused now."""
        try:
            from psycopg.conninfo import conninfo_to_dict
        except ImportError:
            return url  # without the postgres extra the sink is refused when it is built, naming the extra
        try:
            params = conninfo_to_dict(url.get_secret_value())
        except Exception as exc:  # psycopg.ProgrammingError, which quotes what it could not parse
            raise ValueError(mask_userinfo(str(exc).strip().splitlines()[0])) from None
        modes = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
        if params.get("sslmode", "prefer") not in modes:
            raise ValueError(f"sslmode {params['sslmode']!r} must be one of {', '.join(modes)}")
        return url

    @model_validator(mode="after")
    def _tables(self) -> PostgresSinkConfig:
        tables = [table_name(c, s) for c, s in self.columns.items()]
        if len(set(tables)) != len(tables):
            raise ValueError("columns: two columns load into the same table")
        taken = {"row_key", "ref_key", "added_id", "shard", "created_at", "body", "deleted"}
        for column, spec in self.columns.items():
            names = [p.name for p in spec.promote]
            if len(set(names)) != len(names) or taken & set(names):
                raise ValueError(f"columns: {column}: promoted column names repeat, or collide with "
                                 f"{', '.join(sorted(taken))}")
        return self


class IcebergSinkConfig(BaseModel):
    """Apache Iceberg tables in a SQL catalog (:mod:`connectors.sinks.iceberg`): one table per column."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    catalog: SecretStr = Field(description="the SQL catalog's SQLAlchemy URL: sqlite:///catalog.db (a relative path "
                                           "from the file's directory) or postgresql+psycopg://user:pw@host/db")
    warehouse: str = Field(min_length=1, description="where data files go: a local directory (relative to the "
                                                      "file's directory) or a file:// URI")
    catalog_name: str = Field("cellstream", pattern=_NAME, description="the catalog's name in the SQL catalog tables")
    namespace: str = Field("cellstream", pattern=_NAME)
    tables: dict[str, Annotated[str, Field(pattern=_NAME)]] = Field(
        default_factory=dict, description="column -> table; default cells_<column lower>")
    target_file_bytes: int = Field(128 << 20, ge=1 << 20, description="write.target-file-size-bytes of the tables")

    @field_validator("catalog")
    @classmethod
    def _sql_catalog(cls, url: SecretStr) -> SecretStr:
        """A PostgreSQL URL goes through psycopg 3 (SQLAlchemy's default driver is psycopg2, not installed)."""
        text = url.get_secret_value()
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in ("sqlite", "postgresql", "postgresql+psycopg"):
            raise ValueError(f"{mask_userinfo(text)!r} is not sqlite:///PATH or postgresql+psycopg://...")
        return SecretStr(f"postgresql+psycopg://{rest}") if scheme == "postgresql" else url

    def table(self, column: str) -> str:
        """The table ``column`` loads into."""
        return self.tables.get(column) or f"cells_{column.lower()}"


class ParquetSinkSpec(ParquetSinkConfig):
    type: Literal["parquet"]


class PostgresSinkSpec(PostgresSinkConfig):
    type: Literal["postgres"]


class IcebergSinkSpec(IcebergSinkConfig):
    type: Literal["iceberg"]


class ConnectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$", description="the connector's offsets and DLQ name")
    columns: list[str] = Field(min_length=1)
    checkpoint_interval: float = Field(5.0, gt=0, description="seconds between flush-then-commit checkpoints")
    start_from: Literal["beginning", "now"] = "beginning"
    brokers: str | None = Field(None, description="host:port,...: read the tailer's Kafka topics (else the logstore)")
    topic_prefix: str = Field("cells", description="with brokers: the tailer's topics are <prefix>.<column>")
    kafka: KafkaSecurity | Path = Field(
        PLAINTEXT, description="with brokers: TLS and SASL, as Kafka client properties (security.protocol, sasl.*, "
                               "ssl.*) or the path of a properties file, relative to this file")
    page_size: int = Field(1000, ge=1, le=10_000, description="cells read per shard at a time")
    max_attempts: int = Field(5, ge=1, description="attempts at a batch before it is retried cell by cell")
    sink: ParquetSinkSpec | PostgresSinkSpec | IcebergSinkSpec = Field(discriminator="type")
    redrive: RedrivePolicy | None = Field(
        None, description="redrive the connector's dead letters by itself: delay, max_redrives, errors, ... "
                          "(indexer.runtime.redrive; docs/indexer.md, Redrive policies)")

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

    @property
    def kafka_security(self) -> KafkaSecurity:
        """The Kafka client's TLS and SASL settings (a properties file named by ``kafka`` read now)."""
        return self.kafka if isinstance(self.kafka, KafkaSecurity) else load_kafka_config(self.kafka)

    @model_validator(mode="after")
    def _kafka_needs_brokers(self) -> ConnectorConfig:
        if self.brokers is None and self.kafka != PLAINTEXT:
            raise ValueError("kafka: TLS and SASL settings are for a connector that reads Kafka (brokers: ...)")
        return self

    @model_validator(mode="after")
    def _tables_for_columns(self) -> ConnectorConfig:
        if isinstance(self.sink, PostgresSinkSpec):
            missing = [c for c in self.columns if c not in self.sink.columns]
            if missing:
                raise ValueError(f"sink: no table for {', '.join(missing)} (sink.columns.<column>: mode, promote)")
        if isinstance(self.sink, IcebergSinkSpec):
            tables = [self.sink.table(c) for c in self.columns]
            if len(set(tables)) != len(tables):
                raise ValueError("sink.tables: two columns load into the same table")
        return self


def load_connector(source: str | Path) -> ConnectorConfig:
    """A connector's configuration (docs/connectors.md, File options).

    Args:
        source: the YAML file (a Path) or its text (a str). A file's relative paths (the sink's ``root``, the
            ``kafka`` properties file) are taken from its directory.

    Returns:
        The validated configuration.

    Raises:
        ConfigFileError: the file cannot be read or does not validate (a ConfigurationError naming the line
            and the field).
    """
    config = load_yaml(source, ConnectorConfig, "<connector>", "a mapping with name, columns and sink")
    if isinstance(source, Path) and isinstance(config.sink, ParquetSinkSpec) and not config.sink.root.is_absolute():
        sink = config.sink.model_copy(update={"root": source.parent / config.sink.root})
        config = config.model_copy(update={"sink": sink})
    if isinstance(source, Path) and isinstance(config.sink, IcebergSinkSpec):
        config = config.model_copy(update={"sink": _iceberg_paths(config.sink, source.parent)})
    if isinstance(source, Path) and isinstance(config.kafka, Path):
        config = config.model_copy(update={"kafka": load_kafka_config(source.parent / config.kafka)})
    return config


def _iceberg_paths(sink: IcebergSinkSpec, base: Path) -> IcebergSinkSpec:
    """``sink`` with a relative SQLite catalog path and warehouse taken from ``base`` (the file's directory)."""
    update: dict[str, object] = {}
    url = sink.catalog.get_secret_value()
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):  # four slashes: an absolute path
        update["catalog"] = SecretStr(f"sqlite:///{base / url.removeprefix('sqlite:///')}")
    if "://" not in sink.warehouse and not Path(sink.warehouse).is_absolute():
        update["warehouse"] = str(base / sink.warehouse)
    return sink.model_copy(update=update) if update else sink
