"""Configuration: store options and the cluster file.

A target given to :func:`logstore.open` is a store URL, resolved by its scheme through
:data:`logstore.registry.BACKENDS` (``sqlite:///dir``, ``mysql://user:pw@host:port/db``,
``http://host:port``), or the path of a cluster file (TOML) mapping shard ranges to storage nodes::

      shards = 4096
      [[nodes]]
      name = "a"
      url = "mysql://cellstream:secret@db-a:3306/cells"
      shards = "0-2047"
      replicas = ["mysql://cellstream:secret@db-a2:3306/cells"]   # optional
      [[nodes]]
      name = "b"
      url = "mysql://cellstream@db-b:3306/cells"
      password_file = "db-b.password"                          # or password_env = "DB_B_PASSWORD"
      shards = "2048-4095"
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from logstore.cell import DEFAULT_MAX_BODY_BYTES
from logstore.configfile import read_text
from logstore.errors import ConfigFileError, InvalidArgumentError
from logstore.registry import NodeTarget, backend_of, prefixes, url_password, with_password
from logstore.registry import parse_node_url as parse_node_url  # resolved by the backends' table
from logstore.retry import RetryPolicy

DEFAULT_SHARDS = 4096
MAX_SHARDS = 65536


class StoreOptions(BaseModel):
    """Options of an opened store (keyword arguments of :func:`logstore.open`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0, description="limit on a body's MessagePack form")
    max_read_bytes: int = Field(
        16 * 1024 * 1024, gt=0, description="bodies (their MessagePack form) one log read brings, its pages "
        "together: a page is cut short after the cell that spends it, and holds one cell at least "
        "(logstore.persistence.TruncatedPage)")
    compression_level: int = Field(6, ge=0, le=9, description="zlib level of stored bodies")
    pool_size: int = Field(8, ge=1, description="MySQL connections kept per storage node")
    connect_timeout: float = Field(5.0, gt=0)
    read_timeout: float = Field(30.0, gt=0)
    max_statement_bytes: int = Field(
        8 * 1024 * 1024, ge=64 * 1024, description="MySQL packets are split below this size"
    )
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    retry: RetryPolicy = RetryPolicy()
    map_refresh: float = Field(5.0, gt=0, description="seconds between reads of the shard moves the nodes record")
    buffer_after: float | None = Field(
        2.0, gt=0, description="seconds a write waits for an unavailable primary before it is buffered on "
        "another storage node that can hold it (a MySQL node); None: never buffer")
    durable_writes: bool = Field(
        False, description="acknowledge a write to a MySQL node once its primary and another MySQL node both hold "
        "it (that node keeps a copy until the primary's replicas have the cell): a primary lost before its "
        "replicas loses nothing acknowledged; costs a second write")

    @property
    def inflate_limit(self) -> int:
        """The most bytes a stored body inflates to when read: ``max_body_bytes``, and never below its default,
        so bodies written before the limit was lowered still read; more is damage (a CorruptCellError)."""
        return max(self.max_body_bytes, DEFAULT_MAX_BODY_BYTES)


class NodeConfig(BaseModel):
    """A storage node of the cluster file: its URL (a backend's, by scheme), its shards and its replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    url: str = Field(repr=False)
    shards: str | None = Field(None, description='inclusive range "first-last" the node was created with; none '
                               "for a node that joined a running instance (``cellstream nodes add``)")
    replicas: list[str] = Field(default_factory=list, repr=False,
                                description="mysql:// URLs of the primary's replicas: reads fall back to them")
    password_file: Path | None = Field(None, description="file holding the password of url and of the replicas "
                                       "given without one (relative: to the cluster file's folder)")
    password_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                     description="environment variable holding that password, instead")
    _password: str | None = PrivateAttr(None)

    @field_validator("replicas")
    @classmethod
    def _replicas_parse(cls, urls: list[str]) -> list[str]:
        for url in urls:
            try:
                target = parse_node_url(url)
            except InvalidArgumentError as exc:
                raise ValueError(str(exc)) from None
            if not backend_of(url).replicas:
                raise ValueError(f"a replica is a {prefixes(lambda b: b.replicas)} URL, got {target.redacted()}")
        return urls

    @model_validator(mode="after")
    def _replicas_of_primary(self) -> NodeConfig:
        if not self.replicas:
            return self
        backend = backend_of(self.url)
        if not backend.replicas:
            raise ValueError(f"only a {prefixes(lambda b: b.replicas)} storage node has replicas")
        if any(backend_of(url).recorder != backend.recorder for url in self.replicas):
            raise ValueError(f"a replica of a {backend.prefix} storage node is a {backend.prefix} URL")
        return self

    @model_validator(mode="after")
    def _read_password(self, info: ValidationInfo) -> NodeConfig:
        if self.password_file is None and self.password_env is None:
            return self
        if self.password_file is not None and self.password_env is not None:
            raise ValueError("password_file and password_env: give one of them")
        backend = backend_of(self.url)
        if not backend.password:
            raise ValueError(f"only a {prefixes(lambda b: b.password)} storage node takes a password")
        if url_password(self.url) is not None:
            raise ValueError("url holds a password, and password_file or password_env gives one: give it in one place")
        if self.password_file is not None:
            folder = (info.context or {}).get("folder")
            path = folder / self.password_file if isinstance(folder, Path) else self.password_file
            try:
                password = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"password_file {path} cannot be read "
                                 f"({getattr(exc, 'strerror', None) or type(exc).__name__})") from None
            where = f"password_file {path}"
        else:
            password = os.environ.get(str(self.password_env), "")
            where = f"environment variable {self.password_env}"
        if not password:
            raise ValueError(f"{where} is empty or unset")
        self._password = password
        return self

    def _with_password(self, url: str) -> str:
        """``url`` with the node's password (password_file, password_env) when it holds none of its own."""
        if self._password is None or url_password(url) is not None:
            return url
        return with_password(url, self._password)

    @property
    def replica_targets(self) -> list[NodeTarget]:
        return [parse_node_url(self._with_password(url)) for url in self.replicas]

    @field_validator("url")
    @classmethod
    def _url_parses(cls, url: str) -> str:
        try:
            backend = backend_of(url)
            backend.parse(url)
        except InvalidArgumentError as exc:
            raise ValueError(str(exc)) from None
        if not backend.storage_node:
            raise ValueError(f"a storage node is {prefixes(lambda b: b.storage_node)}; {backend.what}'s URL is "
                             "opened directly")
        return url

    @field_validator("shards")
    @classmethod
    def _range_parses(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not re.fullmatch(r"\d+-\d+", value):
            raise ValueError('must be an inclusive range "first-last", e.g. "0-2047"')
        first, last = map(int, value.split("-"))
        if first > last:
            raise ValueError(f"range {value} is empty")
        return value

    @property
    def first(self) -> int:
        """The first shard of the node's home range (0 for a node that joined, whose range is empty)."""
        return int(self.shards.split("-")[0]) if self.shards else 0

    @property
    def last(self) -> int:
        """The last shard of the node's home range (-1 for a node that joined)."""
        return int(self.shards.split("-")[1]) if self.shards else -1

    @property
    def target(self) -> NodeTarget:
        return parse_node_url(self._with_password(self.url))


class ClusterConfig(BaseModel):
    """Storage nodes, each created with a contiguous range of shards; together they cover all shards once. A node
    without a range joined later (``cellstream nodes add``) and holds the shards moved to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shards: int = Field(DEFAULT_SHARDS, ge=1, le=MAX_SHARDS)
    nodes: list[NodeConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _covers_every_shard_once(self) -> ClusterConfig:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        expected = 0
        for node in sorted((n for n in self.nodes if n.shards), key=lambda n: n.first):
            if node.first != expected:
                raise ValueError(
                    f"node {node.name!r} starts at shard {node.first}, expected {expected}: "
                    "ranges must cover 0..shards-1 without gaps or overlaps"
                )
            expected = node.last + 1
        if expected != self.shards:
            raise ValueError(f"node ranges end at shard {expected - 1}, expected {self.shards - 1}")
        return self


def single_node(url: str, shards: int) -> ClusterConfig:
    span = f"0-{shards - 1}"
    if not backend_of(url).storage_node:  # parsed already; a cluster file may not name one
        node = NodeConfig.model_construct(name="node0", url=url, shards=span)
        return ClusterConfig.model_construct(shards=shards, nodes=[node])
    return ClusterConfig(shards=shards, nodes=[NodeConfig(name="node0", url=url, shards=span)])


def load_cluster_file(path: Path) -> ClusterConfig:
    """The cluster file at ``path``, validated.

    Raises:
        ConfigFileError: it cannot be read, is not TOML, or does not validate (the first problem).
    """
    source = f"cluster file {path}"
    text = read_text(path, source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(source, None, "", f"is not valid TOML: {exc}") from None
    try:
        return ClusterConfig.model_validate(data, context={"folder": path.parent})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ConfigFileError(source, None, where, first["msg"]) from None
