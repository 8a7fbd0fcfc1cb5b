"""The tailer's options, as one pydantic model shared by the CLI and library users."""

from __future__ import annotations

import datetime as dt
import re
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from logstore.cell import COLUMN_RE
from tailer.security import PLAINTEXT, KafkaSecurity

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
StartFrom = Literal["beginning", "now"] | AwareDatetime


def check_name(value: str) -> str:
    """A tailer's or an app's name: it becomes part of ZooKeeper paths and consumer names."""
    if not _NAME_RE.fullmatch(value):
        raise ValueError(f"{value!r} must match ^[A-Za-z0-9][A-Za-z0-9_.-]{{0,99}}$")
    return value


def check_zookeeper_auth(value: str) -> str:
    """``user:password`` for ZooKeeper's digest scheme, or ValueError naming what is wrong (never the value)."""
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError("ZooKeeper credentials must be user:password (digest), both non-empty")
    return value


def check_polls(poll_interval: float, idle_poll_interval: float) -> None:
    if idle_poll_interval < poll_interval:
        raise ValueError(f"idle_poll_interval ({idle_poll_interval}) must be >= poll_interval ({poll_interval})")


class TailerConfig(BaseModel):
    """One tailer (``name``): every worker started with the same name shares its shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the tailer's name; its workers, assignment and offsets live under it")
    topic_prefix: str = Field("cells", description="topics are <prefix>.<column>")
    partitions: int = Field(16, ge=1, le=10_000, description="partitions per topic; shard s goes to s mod P")
    replication_factor: int = Field(1, ge=1, le=32)
    columns: tuple[str, ...] | None = Field(
        None, description="publish only these columns (default: every column but the reserved '_' ones)")
    start_from: StartFrom = Field(
        "beginning", description="where a shard with no committed offset starts: beginning, now or a time"
    )
    value_format: Literal["json", "msgpack"] = "json"
    page_size: int = Field(500, ge=1, le=10_000, description="cells read from a shard per query")
    max_in_flight: int = Field(20_000, ge=1, description="unacknowledged messages per worker")
    read_ahead: int | None = Field(
        None, ge=1, le=64, description="read queries under way at once while pages are sent (default: the store's "
        "parallel_reads, 1 for the embedded SQLite, 4 over a server)")
    poll_interval: float = Field(
        0.005, gt=0, description="seconds between count polls of the shards while cells arrive")
    idle_poll_interval: float = Field(
        0.05, gt=0, description="the longest wait between count polls: once no cell has arrived for this long, "
        "the interval doubles at each count poll that finds none, up to it"
    )
    commit_interval: float = Field(1.0, gt=0, description="seconds between offset commits")
    lag_interval: float = Field(2.0, gt=0, description="seconds between lag measurements")
    session_timeout: float = Field(
        10.0, ge=4, le=40, description="ZooKeeper session timeout, seconds (within the server's default 4-40 s)"
    )
    lease_fraction: float = Field(
        0.8, gt=0, lt=1,
        description="a worker stops publishing when it has not reached ZooKeeper for this part of the session",
    )
    stop_timeout: float = Field(30.0, gt=0, description="seconds a graceful stop waits for acknowledgements")
    per_shard_metrics: bool = Field(
        False, description="also export lag series per owned shard (4096 shards make 8192 series); by default "
                           "only the totals and the most lagging shards are exported",
    )
    top_lagging_shards: int = Field(
        10, ge=0, le=1000, description="how many of the most lagging shards get their own lag series",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("topic_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not _TOPIC_RE.fullmatch(value):
            raise ValueError(f"{value!r} may hold only letters, digits, '.', '_' and '-'")
        return value

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None:
            if not value:
                raise ValueError("give at least one column, or none to publish every column")
            for column in value:
                if not COLUMN_RE.fullmatch(column):
                    raise ValueError(f"column {column!r} must match ^[A-Za-z_][A-Za-z0-9_]{{0,63}}$")
        return value

    @model_validator(mode="after")
    def _polls(self) -> TailerConfig:
        check_polls(self.poll_interval, self.idle_poll_interval)
        return self

    @property
    def deadletter_topic(self) -> str:
        # '-' never appears in a column name, so this cannot collide with a cell topic.
        return f"{self.topic_prefix}-deadletter"

    def topic(self, column: str) -> str:
        return f"{self.topic_prefix}.{column}"


class KafkaOptions(BaseModel):
    """How the Kafka publisher connects and batches. acks=all and idempotence are not optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    brokers: str = "127.0.0.1:9092"
    client_id: str = "cellstream-tailer"
    linger_ms: int = Field(
        2, ge=0, description="how long a single message (a dead letter) waits for others to share its request; "
        "cell batches leave as soon as their partition has none in flight"
    )
    max_batch_size: int = Field(256 * 1024, ge=1024)
    max_request_size: int = Field(
        1_000_000, ge=1024, description="messages above this are dead-lettered; keep it <= the broker's limit"
    )
    request_timeout_ms: int = Field(30_000, ge=1000)
    compression: Literal["none", "gzip"] = "none"
    security: KafkaSecurity = Field(PLAINTEXT, description="TLS and SASL (Kafka's client properties)")


def parse_start(value: str) -> StartFrom:
    """``beginning``, ``now`` or an ISO-8601 time with a zone (``Z`` accepted)."""
    if value in ("beginning", "now"):
        return value  # type: ignore[return-value]
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"--from must be beginning, now or an ISO-8601 time, got {value!r}") from None
    if when.tzinfo is None:
        raise ValueError(f"--from time {value!r} needs a zone, e.g. {value}Z")
    return when
