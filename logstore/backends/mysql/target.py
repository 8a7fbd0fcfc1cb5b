"""A MySQL/MariaDB storage node's URL: ``mysql://user:password@host:port/database``, with TLS parameters if
needed (``?ssl_ca=/etc/ca.pem&ssl_cert=...&ssl_key=...&ssl_mode=VERIFY_IDENTITY``, see :class:`MySQLTarget`).
Parsed without pymysql: a URL is checked (and redacted for messages) where the extra is not installed."""

from __future__ import annotations

import functools
import os
import re
import ssl
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field

from logstore.errors import InvalidArgumentError
from logstore.tls import client_context

SSLMode = Literal["DISABLED", "PREFERRED", "REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY"]
_TLS_PARAMS = ("ssl_mode", "ssl_ca", "ssl_cert", "ssl_key")
_DB_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


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
        """pymysql's TLS arguments: ``ssl_disabled`` for DISABLED, else an SSLContext, made once per target
        (loading the system's CAs costs far more than a connection). With a context pymysql refuses a server
        without TLS; for PREFERRED the recorder then connects again with ``ssl_disabled``."""
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


def _tls_params(query: str) -> dict[str, Any]:
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


def parse_url(url: str) -> MySQLTarget:
    """The target of a ``mysql://`` URL; InvalidArgumentError naming what is wrong with it."""
    try:
        if not url.startswith("mysql://"):
            raise ValueError
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
        **_tls_params(parts.query),
    )
