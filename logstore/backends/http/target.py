"""A worker node's URL: ``http://host:port``, or ``https://host:port?ssl_ca=CA.pem`` for one serving TLS with
a certificate the system's CAs do not sign. The token is never part of the URL."""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, ConfigDict, Field

from logstore.errors import InvalidArgumentError
from logstore.net import mask_userinfo
from logstore.tls import client_context


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


def parse_url(url: str) -> HttpTarget:
    """The target of an ``http://`` or ``https://`` URL; InvalidArgumentError naming what is wrong with it."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises on a bad port
    except ValueError:
        raise InvalidArgumentError(
            f"worker node URL {mask_userinfo(url)!r} cannot be parsed: http://host:port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.fragment or parts.username:
        raise InvalidArgumentError(f"worker node URL {mask_userinfo(url)!r}: expected http://host:port (a token goes "
                                   "in the token argument, not the URL)")
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(params) - {"ssl_ca"})
    if unknown:
        raise InvalidArgumentError(f"worker node URL: unknown parameter {unknown[0]!r} (it takes ssl_ca)")
    if params and parts.scheme != "https":
        raise InvalidArgumentError("worker node URL: ssl_ca needs an https:// URL")
    base = parts._replace(query="").geturl().rstrip("/")
    return HttpTarget(url=base, ssl_ca=Path(params["ssl_ca"]) if params.get("ssl_ca") else None)
