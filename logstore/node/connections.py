"""The worker node's connections: aiohttp's per-connection handler with the limits a node facing untrusted
clients needs, and errors from aiohttp's HTTP parser as the node's JSON error document.

- A request's head (request line and headers) must arrive within ``header_timeout`` seconds of the
  connection opening or of the request's first byte; otherwise the node answers 408 and closes (a client
  trickling headers holds a connection for that long at most). An idle kept-alive connection closes
  after ``idle_timeout``. The body's deadline is the request handler's (``body_timeout``); the rest of a
  body not read (an answer sent before it) is drained for 2 s at most, not aiohttp's 10.
- At most ``max_connections`` connections at once: one more is answered 503 (retriable, Retry-After) and closed.
- A request the parser refuses (an unknown method, a path that is not UTF-8, Content-Length with chunked
  encoding, an oversize line or header) gets the JSON error document, and is logged at DEBUG, without a
  traceback: it is the client's error, not the node's.

aiohttp has no header deadline or connection cap of its own, so the node makes its connections itself
(``loop.create_server`` with :func:`protocol_factory`) from aiohttp's public ``RequestHandler``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_request import BaseRequest

from logstore.node import wire

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    header_timeout: float
    idle_timeout: float
    max_connections: int
    max_line_bytes: int = 8190
    linger: float = 2.0  # after an answer sent before its request's body was read: to drain it, at most


def error_document(kind: str, message: str, retriable: bool = False) -> bytes:
    return wire.dumps(wire.error(kind, message, retriable))


def raw_response(status: int, reason: str, body: bytes, retry_after: bool = False) -> bytes:
    """A whole HTTP/1.1 response, for connections no request handler serves."""
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    if retry_after:
        head += "Retry-After: 1\r\n"
    return head.encode() + b"\r\n" + body


class Connection(web.RequestHandler):
    """One client connection (see the module docstring)."""

    def __init__(self, manager: web.Server, *, limits: Limits, on_error: Callable[[int], None],
                 **kwargs: Any) -> None:
        # access_log=None: no access log (aiohttp's own runners pass None too, though its annotation says Logger)
        super().__init__(manager, keepalive_timeout=limits.idle_timeout, access_log=None,  # type: ignore[arg-type]
                         max_line_size=limits.max_line_bytes, max_field_size=limits.max_line_bytes,
                         lingering_time=limits.linger, **kwargs)
        self.limits = limits
        self.on_error = on_error
        self.deadline: asyncio.TimerHandle | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.deadline is None and not self.busy:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def request_started(self) -> None:
        """Its head arrived (the request handler runs): no header deadline until the next request."""
        self._disarm()
        self.busy = True

    def request_finished(self) -> None:
        self.busy = False

    def _arm(self) -> None:
        self.deadline = asyncio.get_running_loop().call_later(self.limits.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _too_slow(self) -> None:
        self.deadline = None
        transport = self.transport
        if transport is None or transport.is_closing() or self.busy:
            return
        message = f"the request's head did not arrive within {self.limits.header_timeout:g} s"
        transport.write(raw_response(408, "Request Timeout", error_document("RequestTimeout", message)))
        transport.close()
        self.on_error(408)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse or serve, as the JSON error document."""
        if status >= 500:
            logger.error("worker node: error handling a request from %s", request.remote, exc_info=exc)
        else:
            logger.debug("worker node: refused a request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:  # part of a response went out: nothing else can be sent
            raise ConnectionError("the response was partly sent already")
        kind = "BadHttpRequest" if status < 500 else "InternalError"
        text = str(getattr(exc, "message", None) or message or exc or "the request could not be served")
        if status >= 500:
            text = "the worker node failed unexpectedly; its log says why"
        response = web.Response(body=error_document(kind, text.strip()), status=status,
                                content_type="application/json")
        response.force_close()
        self.on_error(status)
        return response


class Refused(asyncio.Protocol):
    """A connection over ``max_connections``: a 503 and the connection closed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        message = f"the worker node is at its limit of {self.limit} connections; retry later"
        body = error_document("TooManyConnections", message, retriable=True)
        transport.write(raw_response(503, "Service Unavailable", body, retry_after=True))  # type: ignore[attr-defined]
        transport.close()


def protocol_factory(manager: web.Server, limits: Limits, on_error: Callable[[int], None]
                     ) -> Callable[[], asyncio.Protocol]:
    loop = asyncio.get_running_loop()

    def make() -> asyncio.Protocol:
        if len(manager.connections) >= limits.max_connections:
            on_error(503)
            return Refused(limits.max_connections)
        return Connection(manager, limits=limits, on_error=on_error, loop=loop)

    return make
