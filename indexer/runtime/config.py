"""An app's options, as one pydantic model (``App(name, store=..., **options)``)."""

from __future__ import annotations

from os import PathLike

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from indexer.runtime.policy import DEFAULT_BACKOFF
from logstore.retry import RetryPolicy
from tailer.config import StartFrom, check_name, check_polls, check_zookeeper_auth
from tailer.security import PLAINTEXT, KafkaSecurity, load_kafka_config


class AppConfig(BaseModel):
    """How an app consumes the cell stream. Apps with the same ``name`` share their shards and offsets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the app's name: its offsets, dead letters and consumer group live under it")
    stall_threshold: int = Field(
        100, ge=1, description="a handler stops when dead-lettering another cell would leave more open entries"
    )
    backoff: RetryPolicy = Field(DEFAULT_BACKOFF, description="pauses between a handler's attempts at one cell")
    concurrency: int = Field(8, ge=1, le=256, description="threads running synchronous handlers (shards in parallel)")
    max_active_shards: int = Field(
        256, ge=1, le=100_000,
        description="direct mode: handler batches at the same time (a batch holds one shard's cells or "
                    "several shards'); what waits is taken in the order it became ready, each shard's cells in order",
    )
    start_from: StartFrom = Field("beginning", description="where a shard with no committed offset starts")
    page_size: int = Field(500, ge=1, le=10_000)
    max_in_flight: int = Field(10_000, ge=1, description="cells read but not yet handled, per process")
    commit_interval: float | None = Field(
        None, gt=0, description="seconds between offset commits; default 1 in direct mode, 3 in Kafka mode"
    )
    poll_interval: float = Field(0.005, gt=0, description="seconds between count polls of the log while cells arrive")
    idle_poll_interval: float = Field(
        0.05, gt=0, description="the longest wait between count polls while the log is idle")
    index_lag_interval: float = Field(
        5.0, gt=0, description="seconds between measures of each kept index version's lag (two reads per shard)")
    dlq_recount_interval: float = Field(
        5.0, gt=0, description="seconds between counts of the open dead letters in the store: the stall threshold "
                               "and cellstream_app_dlq_open follow replays and discards made elsewhere (the CLI, "
                               "the console, another process) within that time")
    stop_timeout: float = Field(30.0, gt=0, description="seconds a stop waits for handlers already running")
    zookeeper: str | None = Field(None, description="host:port[/chroot]: share shards between processes (direct mode)")
    zookeeper_auth: SecretStr | None = Field(
        None, description="user:password: authenticate to ZooKeeper (digest) and give the znodes the app creates "
                          "an ACL for that user alone")
    per_shard_metrics: bool = Field(
        False, description="direct mode: export the source's lag per shard too, not only totals and the most "
                           "lagging shards",
    )
    session_timeout: float = Field(10.0, ge=4, le=40, description="ZooKeeper session timeout, seconds")
    topic_prefix: str = Field("cells", description="Kafka mode: the tailer's topics are <prefix>.<column>")
    replication_factor: int = Field(1, ge=1, le=32, description="Kafka mode: replicas of the <name>.dlq topic")
    fetch_wait: float = Field(
        0.005, ge=0, le=0.5, description="Kafka mode: seconds the broker may hold a fetch to gather 64 KiB of "
                                         "records (fetch.wait.max.ms); 0 answers a fetch at its first record: the "
                                         "lowest latency, and several times the CPU at a steady trickle")
    kafka: KafkaSecurity = Field(
        PLAINTEXT, description="Kafka mode: TLS and SASL, as Kafka client properties ({'security.protocol': "
                               "'SASL_SSL', ...}) or the path of a properties file (see tailer.security)")

    @field_validator("kafka", mode="before")
    @classmethod
    def _kafka_file(cls, value: object) -> object:
        return load_kafka_config(value) if isinstance(value, str | PathLike) else value

    def commit_every(self, kafka: bool) -> float:
        """The commit interval in effect: ``commit_interval`` if set, else 1 s in direct mode and 3 s in Kafka
        mode, where a commit is a round trip to the group coordinator (docs/benchmarks.md, Kafka mode)."""
        if self.commit_interval is not None:
            return self.commit_interval
        return 3.0 if kafka else 1.0

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("zookeeper_auth")
    @classmethod
    def _auth(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_zookeeper_auth(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _polls(self) -> AppConfig:
        check_polls(self.poll_interval, self.idle_poll_interval)
        return self
