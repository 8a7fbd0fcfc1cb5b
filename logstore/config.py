"""Configuration: store options, storage node URLs and the cluster file.

A target given to :func:`logstore.open` is one of
- ``sqlite:///relative/dir`` or ``sqlite:////absolute/dir`` (SQLAlchemy's convention),
- ``mysql://user:password@host:port/database``, with TLS parameters if needed
  (``?ssl_ca=/etc/ca.pem&ssl_cert=...&ssl_key=...&ssl_mode=VERIFY_IDENTITY``, see :class:`MySQLTarget`),
- a path to a cluster file (TOML) mapping shard ranges to storage nodes::

      shards = 4096
      [[nodes]]
      name = "a"
      url = "mysql://cellstream:secret@db-a:3306/cells"
      shards = "0-2047"
      replicas = ["mysql://cellstream:secret@db-a2:3306/cells"]   # optional
      [[nodes]]
      name = "b"
      url = "mysql://cellstream:secret@db-b:3306/cells"
      shards = "2048-4095"
"""

from __future__ import annotations

import functools
import os
import re
import ssl
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from logstore.errors import ConfigurationError, InvalidArgumentError
from logstore.retry import RetryPolicy
from logstore.tls import client_context

DEFAULT_SHARDS = 4096
MAX_SHARDS = 65536
_DB_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


class StoreOptions(BaseModel):
    """Options of an opened store (keyword arguments of :func:`logstore.open`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="limit on a body's MessagePack form")
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


SSLMode = Literal["DISABLED", "PREFERRED", "REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY"]
_TLS_PARAMS = ("ssl_mode", "ssl_ca", "ssl_cert", "ssl_key")


class MySQLTarget(BaseModel):
    """A MySQL/MariaDB storage node. TLS follows MySQL's ``--ssl-mode``: DISABLED; PREFERRED (encrypted when
    the server offers it, the certificate unchecked: the default without ``ssl_ca``); REQUIRED (encrypted,
    unchecked); VERIFY_CA (the certificate signed by ``ssl_ca``, or the system's CAs); VERIFY_IDENTITY (that,
    and it names the host: the default with ``ssl_ca``). ``ssl_cert`` and ``ssl_key`` are the client's."""

    model_config = ConfigDict(frozen=True)

    host: str
    port: int
    user: str
    password: str = Field(repr=False)
    database: str
    ssl_mode: SSLMode = "PREFERRED"
    ssl_ca: Path | None = None
    ssl_cert: Path | None = None
    ssl_key: Path | None = None

    def redacted(self) -> str:
        query = "&".join(f"{k}={getattr(self, k)}" for k in _TLS_PARAMS
                         if k in self.model_fields_set and getattr(self, k) is not None)
        return f"mysql://{self.user}:***@{self.host}:{self.port}/{self.database}" + (f"?{query}" if query else "")

    def ssl_options(self) -> dict[str, Any]:
        """pymysql's TLS arguments: ``ssl_disabled`` for DISABLED, else an SSLContext, made once per target (loading
        the system's CAs costs about 20 ms, a connection about one). With a context pymysql refuses a server
        without TLS; for PREFERRED the connector then connects again with ``ssl_disabled``."""
        if self.ssl_mode == "DISABLED":
            return {"ssl_disabled": True}
        return {"ssl": _client_context(self)}


@functools.lru_cache(maxsize=256)
def _client_context(target: MySQLTarget) -> ssl.SSLContext:
    if target.ssl_mode == "PREFERRED":
        # The certificate is not checked, so no CA store is loaded (pymysql's own PREFERRED context loads one for
        # every connection).
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return client_context(f"storage node {target.redacted()}", ca=target.ssl_ca, cert=target.ssl_cert,
                          key=target.ssl_key, verify=target.ssl_mode != "REQUIRED",
                          check_hostname=target.ssl_mode == "VERIFY_IDENTITY")


def _mysql_tls(query: str) -> dict[str, Any]:
    """The TLS parameters of a mysql:// URL's query (see MySQLTarget); each one at most once, each file readable."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidArgumentError(f"mysql URL query {query!r} cannot be parsed: ?ssl_ca=PATH&...") from None
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key not in _TLS_PARAMS:
            raise InvalidArgumentError(f"mysql URL parameter {key!r} is not one cellstream takes "
                                       f"({', '.join(_TLS_PARAMS)})")
        if key in found:
            raise InvalidArgumentError(f"mysql URL parameter {key} is given twice")
        found[key] = value
    if "ssl_mode" in found:
        mode = found["ssl_mode"].upper()
        if mode not in SSLMode.__args__:  # type: ignore[attr-defined]
            raise InvalidArgumentError(f"mysql URL ssl_mode {found['ssl_mode']!r} must be one of "
                                       f"{', '.join(SSLMode.__args__)}")  # type: ignore[attr-defined]
        found["ssl_mode"] = mode
    for key in ("ssl_ca", "ssl_cert", "ssl_key"):
        if key in found:
            if not os.access(found[key], os.R_OK):
                raise InvalidArgumentError(f"mysql URL {key} {found[key]!r} cannot be read")
            found[key] = Path(found[key])
    if ("ssl_cert" in found) != ("ssl_key" in found):
        raise InvalidArgumentError("mysql URL ssl_cert and ssl_key go together")
    if "ssl_mode" not in found and found:
        found["ssl_mode"] = "VERIFY_IDENTITY" if "ssl_ca" in found else "REQUIRED"
    if found.get("ssl_mode") in ("DISABLED", "PREFERRED") and len(found) > 1:
        raise InvalidArgumentError(f"mysql URL ssl_mode {found['ssl_mode']} would ignore "
                                   f"{', '.join(sorted(set(found) - {'ssl_mode'}))}")
    return found


class SQLiteTarget(BaseModel):
    model_config = ConfigDict(frozen=True)

    directory: Path

    def redacted(self) -> str:
        return f"sqlite:///{self.directory}"


class HttpTarget(BaseModel):
    """A worker node (``cellstream serve``): the logstore API over HTTP, for :func:`logstore.open` only."""

    model_config = ConfigDict(frozen=True)

    url: str
    ssl_ca: Path | None = Field(None, description="CA (PEM) an https:// node's certificate is checked against "
                                                  "(default: the system's)")

    def redacted(self) -> str:
        return self.url

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https://"):
            return None
        return client_context(f"worker node {self.url}", ca=self.ssl_ca)


NodeTarget = MySQLTarget | SQLiteTarget | HttpTarget


def parse_node_url(url: str) -> NodeTarget:
    if url.startswith(("http://", "https://")):
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  # raises on a bad port
        except ValueError:
            raise InvalidArgumentError(f"worker node URL {url!r} cannot be parsed: http://host:port") from None
        if not parts.hostname or parts.fragment or parts.username:
            raise InvalidArgumentError(f"worker node URL {url!r}: expected http://host:port (a token goes "
                                       "in the token argument, not the URL)")
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(params) - {"ssl_ca"})
        if unknown:
            raise InvalidArgumentError(f"worker node URL: unknown parameter {unknown[0]!r} (it takes ssl_ca)")
        if params and parts.scheme != "https":
            raise InvalidArgumentError("worker node URL: ssl_ca needs an https:// URL")
        base = parts._replace(query="").geturl().rstrip("/")
        return HttpTarget(url=base, ssl_ca=Path(params["ssl_ca"]) if params.get("ssl_ca") else None)
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if not path:
            raise InvalidArgumentError("sqlite URL needs a directory: sqlite:///path/to/dir")
        return SQLiteTarget(directory=Path(path))
    if url.startswith("mysql://"):
        try:
            parts = urlsplit(url)
        except ValueError:
            raise InvalidArgumentError("mysql URL cannot be parsed: mysql://user:pw@host:port/db") from None
        database = parts.path.lstrip("/")
        if not _DB_NAME.fullmatch(database):
            raise InvalidArgumentError(
                "mysql URL needs a database name of letters, digits and _: mysql://user:pw@host:port/db"
            )
        try:
            port = parts.port or 3306
        except ValueError:
            raise InvalidArgumentError("mysql URL has an invalid port") from None
        return MySQLTarget(
            host=parts.hostname or "127.0.0.1",
            port=port,
            user=unquote(parts.username or "root"),
            password=unquote(parts.password or ""),
            database=database,
            **_mysql_tls(parts.query),
        )
    scheme = url.split(":", 1)[0] if ":" in url else url
    raise InvalidArgumentError(f"unsupported store URL scheme {scheme!r} (use sqlite:///, mysql:// or http://)")


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    url: str = Field(repr=False)
    shards: str = Field(description='inclusive range "first-last"')
    replicas: list[str] = Field(default_factory=list, repr=False,
                                description="mysql:// URLs of the primary's replicas: reads fall back to them")

    @field_validator("replicas")
    @classmethod
    def _replicas_parse(cls, urls: list[str]) -> list[str]:
        for url in urls:
            try:
                target = parse_node_url(url)
            except InvalidArgumentError as exc:
                raise ValueError(str(exc)) from None
            if not isinstance(target, MySQLTarget):
                raise ValueError(f"a replica is a mysql:// URL, got {target.redacted()}")
        return urls

    @model_validator(mode="after")
    def _replicas_of_mysql(self) -> NodeConfig:
        if self.replicas and not isinstance(parse_node_url(self.url), MySQLTarget):
            raise ValueError("only a mysql:// storage node has replicas")
        return self

    @property
    def replica_targets(self) -> list[MySQLTarget]:
        return [t for t in map(parse_node_url, self.replicas) if isinstance(t, MySQLTarget)]

    @field_validator("url")
    @classmethod
    def _url_parses(cls, url: str) -> str:
        try:
            target = parse_node_url(url)
        except InvalidArgumentError as exc:
            raise ValueError(str(exc)) from None
        if isinstance(target, HttpTarget):
            raise ValueError("a storage node is sqlite:/// or mysql://; a worker node's URL is opened directly")
        return url

    @field_validator("shards")
    @classmethod
    def _range_parses(cls, value: str) -> str:
        if not re.fullmatch(r"\d+-\d+", value):
            raise ValueError('must be an inclusive range "first-last", e.g. "0-2047"')
        first, last = map(int, value.split("-"))
        if first > last:
            raise ValueError(f"range {value} is empty")
        return value

    @property
    def first(self) -> int:
        return int(self.shards.split("-")[0])

    @property
    def last(self) -> int:
        return int(self.shards.split("-")[1])

    @property
    def target(self) -> NodeTarget:
        return parse_node_url(self.url)


class ClusterConfig(BaseModel):
    """Storage nodes, each owning a contiguous range of shards; together they cover all shards once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shards: int = Field(DEFAULT_SHARDS, ge=1, le=MAX_SHARDS)
    nodes: list[NodeConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _covers_every_shard_once(self) -> ClusterConfig:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        expected = 0
        for node in sorted(self.nodes, key=lambda n: n.first):
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
    if isinstance(parse_node_url(url), HttpTarget):  # parsed already; a cluster file may not name one
        node = NodeConfig.model_construct(name="node0", url=url, shards=span)
        return ClusterConfig.model_construct(shards=shards, nodes=[node])
    return ClusterConfig(shards=shards, nodes=[NodeConfig(name="node0", url=url, shards=span)])


def load_cluster_file(path: Path) -> ClusterConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"cannot read cluster file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigurationError(f"cluster file {path} is not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"cluster file {path} is not valid TOML: {exc}") from None
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ConfigurationError(f"cluster file {path}: {where}: {first['msg']}") from None
