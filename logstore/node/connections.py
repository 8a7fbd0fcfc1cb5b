"""Connections of a server facing untrusted clients (the worker node, the console): aiohttp's per-connection
handler with the limits such a server needs, and errors from aiohttp's HTTP parser as the server's error
document (the worker node's JSON; plain text for the console: :class:`ErrorStyle`).

- A request's head (request line and headers) must arrive within ``header_timeout`` seconds of the
  connection opening or of the request's first byte; otherwise the server answers 408 and closes (a client
  trickling headers holds a connection for that long at most). An idle kept-alive connection closes
  after ``idle_timeout``. The body's deadline is the request handler's (``body_timeout``); the rest of a
  body not read (an answer sent before it) is drained for 2 s at most, not aiohttp's 10.
- At most ``max_connections`` connections at once: one more is answered 503 (retriable, Retry-After) and closed.
- At most ``max_connections_per_client`` of them from one client address (an IPv6 address's /64): one more
  is answered 503 the same way, saying so, so that one client cannot take every connection and starve the
  others. The count of each address is exact as connections close.
- A request the parser refuses (a malformed method, a path that is not UTF-8, Content-Length with chunked
  encoding, an oversize line or header) gets the error document, and is logged at DEBUG, without a
  traceback: it is the client's error, not the server's. A well-formed method the parser does not know
  (``BREW``, ``get``) is a 501 (RFC 9110 9.1), not a 400. A body the client cuts off or garbles, met while
  aiohttp drains it after the answer, is logged at DEBUG too.

aiohttp has no header deadline or connection cap of its own, so a server makes its connections itself
(``loop.create_server`` with :func:`protocol_factory`) from aiohttp's public ``RequestHandler``; its
handlers must call :meth:`Connection.request_started` and :meth:`Connection.request_finished` (the
:func:`track_requests` middleware does), or a request running longer than ``header_timeout`` is cut off.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http_exceptions import BadHttpMethod
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_request import BaseRequest

from logstore.node import wire

logger = logging.getLogger(__name__)

# The reasons on_error is told, besides the status.
UNPARSABLE = "unparsable"  # 400 (or another 4xx of the parser)
SLOW_HEAD = "slow_head"  # 408
INTERNAL = "internal"  # 500
MAX_CONNECTIONS = "max_connections"  # 503: the server is full
MAX_PER_CLIENT = "max_connections_per_client"  # 503: this client holds its share
UNKNOWN_METHOD = "unknown_method"  # 501: a well-formed method the parser does not know (BREW, get)

# A method is a token (RFC 9110 5.6.2); the parser's message quotes the request line as a bytes repr.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_QUOTED_LINE = re.compile(r"\n {2}b['\"]([^ ]*) [^ ]+ HTTP/[0-9]\.[0-9](?:\\r\\n|['\"]\n)")

OnError = Callable[[int, str], None]


@dataclass(frozen=True)
class Limits:
    header_timeout: float
    idle_timeout: float
    max_connections: int
    max_line_bytes: int = 8190
    max_headers: int = 128  # fields in a head: each under max_line_bytes, so a head holds about 1 MiB at most
    linger: float = 2.0  # after an answer sent before its request's body was read: to drain it, at most
    max_connections_per_client: int = 64  # of max_connections; more than it in effect only when lower


def error_document(kind: str, message: str, retriable: bool = False) -> bytes:
    return wire.dumps(wire.error(kind, message, retriable))


def text_document(kind: str, message: str, retriable: bool = False) -> bytes:
    """An error as plain text: its message (for people, in a browser)."""
    return f"{message}\n".encode()


@dataclass(frozen=True)
class ErrorStyle:
    """What a server's answers made before any route say and look like."""

    server: str  # in messages: "the {server} is at its limit ..." and log lines
    content_type: str
    render: Callable[[str, str, bool], bytes]  # (kind, message, retriable) -> the body


JSON_ERRORS = ErrorStyle("worker node", "application/json", error_document)


def raw_response(status: int, reason: str, body: bytes, retry_after: bool = False,
                 content_type: str = "application/json") -> bytes:
    """A whole HTTP/1.1 response, for connections no request handler serves."""
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    if retry_after:
        head += "Retry-After: 1\r\n"
    return head.encode() + b"\r\n" + body


def client_of(peer: Any) -> str:
    """The client a connection from ``peer`` (a transport's ``peername``) counts for: its IP address, or the
    /64 of an IPv6 address (a host commonly holds a whole /64); "" for a peer without one (a Unix socket)."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return ""
    try:
        address = ipaddress.ip_address(peer[0])
    except ValueError:
        return peer[0]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(address), 64), strict=False))
    return str(address)


class ClientCounts:
    """Connections open per client (:func:`client_of`), at most ``limit`` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}

    def admit(self, client: str) -> bool:
        """Count one more connection of ``client``; False (not counted) when it holds ``limit`` already."""
        held = self.open.get(client, 0)
        if held >= self.limit:
            return False
        self.open[client] = held + 1
        return True

    def release(self, client: str) -> None:
        """One connection of ``client`` admitted before has closed."""
        held = self.open.pop(client, 0) - 1
        if held > 0:
            self.open[client] = held  # an address with none open is forgotten: the map holds open ones only


def _refuse(transport: asyncio.BaseTransport, errors: ErrorStyle, message: str) -> None:
    body = errors.render("TooManyConnections", message, True)
    transport.write(raw_response(503, "Service Unavailable", body, retry_after=True,  # type: ignore[attr-defined]
                                 content_type=errors.content_type))
    transport.close()


class Connection(web.RequestHandler):
    """One client connection (see the module docstring)."""

    def __init__(self, manager: web.Server, *, limits: Limits, on_error: OnError,
                 errors: ErrorStyle = JSON_ERRORS, clients: ClientCounts | None = None, **kwargs: Any) -> None:
        # access_log=None: no access log (aiohttp's own runners pass None too, though its annotation says Logger)
        super().__init__(manager, keepalive_timeout=limits.idle_timeout, access_log=None,  # type: ignore[arg-type]
                         max_line_size=limits.max_line_bytes, max_field_size=limits.max_line_bytes,
                         max_headers=limits.max_headers,
                         lingering_time=limits.linger, **kwargs)
        self.limits = limits
        self.on_error = on_error
        self.errors = errors
        self.clients = clients if clients is not None else ClientCounts(limits.max_connections_per_client)
        self.client: str | None = None  # set while counted in clients
        self.refused = False
        self.deadline: asyncio.TimerHandle | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        client = client_of(transport.get_extra_info("peername"))
        if not self.clients.admit(client):
            # Never handed to aiohttp: no request of it is read, and the server does not count it.
            self.refused = True
            self.on_error(503, MAX_PER_CLIENT)
            _refuse(transport, self.errors, f"this client address holds the {self.errors.server}'s limit of "
                                            f"{self.clients.limit} connections per client; retry later")
            return
        self.client = client
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.deadline is None and not self.busy:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)

    def eof_received(self) -> None:
        if not self.refused:
            super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        self._disarm()
        if self.client is not None:
            self.clients.release(self.client)
            self.client = None
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
        transport.write(raw_response(408, "Request Timeout", self.errors.render("RequestTimeout", message, False),
                                     content_type=self.errors.content_type))
        transport.close()
        self.on_error(408, SLOW_HEAD)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse or serve, as the server's error document."""
        server = self.errors.server
        if status >= 500:
            logger.error("%s: error handling a request from %s", server, request.remote, exc_info=exc)
        else:
            logger.debug("%s: refused a request from %s: %s", server, request.remote, message or exc)
        if request.writer.output_size > 0:  # part of a response went out: nothing else can be sent
            raise ConnectionError("the response was partly sent already")
        kind = "BadHttpRequest" if status < 500 else "InternalError"
        text = str(getattr(exc, "message", None) or message or exc or "the request could not be served")
        unknown = unknown_method(exc) if status == 400 else None
        if unknown is not None:  # RFC 9110 9.1: a method the server does not recognize is a 501, not a 400
            status, kind = 501, "NotImplemented"
            text = (f"the {server} knows no method {unknown!r} (methods are case-sensitive: "
                    "GET, HEAD, POST, PUT, ...)")
        elif status >= 500:
            text = f"the {server} failed unexpectedly; its log says why"
        response = web.Response(body=self.errors.render(kind, text.strip(), False), status=status,
                                content_type=self.errors.content_type)
        response.force_close()
        self.on_error(status, UNKNOWN_METHOD if unknown is not None else UNPARSABLE if status < 500 else INTERNAL)
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's log of a failure outside a handler: a body the client cut off or sent undecodable (bad
        Content-Encoding), met while draining it after the answer, is the client's error: DEBUG, no traceback."""
        exc = kw.get("exc_info")
        if isinstance(exc, RequestPayloadError | ConnectionResetError):
            logger.debug("%s: a request's body could not be read: %s", self.errors.server, exc)
            return
        super().log_exception(*args, **kw)


def unknown_method(exc: BaseException | None) -> str | None:
    """The method of a request line the parser refused for its method, when it is a well-formed token that
    is no method the parser knows (``BREW``, or ``get``: methods are case-sensitive); None otherwise (a
    method with a control character is malformed: a 400)."""
    if not isinstance(exc, BadHttpMethod):
        return None
    found = _QUOTED_LINE.search(str(getattr(exc, "message", "")))
    if found is None or not _TOKEN.fullmatch(found[1]) or found[1] in hdrs.METH_ALL:
        return None
    return found[1]


@web.middleware
async def track_requests(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Tells the request's :class:`Connection` when its handler runs (the outermost middleware)."""
    connection = request.protocol
    if not isinstance(connection, Connection):
        return await handler(request)
    connection.request_started()
    try:
        return await handler(request)
    finally:
        connection.request_finished()


class Refused(asyncio.Protocol):
    """A connection over ``max_connections``: a 503 and the connection closed."""

    def __init__(self, limit: int, errors: ErrorStyle = JSON_ERRORS) -> None:
        self.limit = limit
        self.errors = errors

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _refuse(transport, self.errors, f"the {self.errors.server} is at its limit of {self.limit} connections; "
                                        "retry later")


class ConnectionFactory:
    """The protocol factory of ``loop.create_server``: a :class:`Connection` for each client connection, or
    :class:`Refused` over the cap. ``clients``: the connections open per client address."""

    def __init__(self, manager: web.Server, limits: Limits, on_error: OnError, errors: ErrorStyle) -> None:
        self.manager = manager
        self.limits = limits
        self.on_error = on_error
        self.errors = errors
        self.clients = ClientCounts(limits.max_connections_per_client)
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> asyncio.Protocol:
        if len(self.manager.connections) >= self.limits.max_connections:
            self.on_error(503, MAX_CONNECTIONS)
            return Refused(self.limits.max_connections, self.errors)
        return Connection(self.manager, limits=self.limits, on_error=self.on_error, errors=self.errors,
                          clients=self.clients, loop=self.loop)


def protocol_factory(manager: web.Server, limits: Limits, on_error: OnError, *,
                     errors: ErrorStyle = JSON_ERRORS) -> ConnectionFactory:
    """Connections of ``manager`` (an ``AppRunner``'s server) under ``limits``, from the running loop.

    Args:
        manager: the aiohttp server whose application answers the requests.
        limits: deadlines and connection caps.
        on_error: called with the status and the reason (a constant of this module) of every answer made
            before a route: a parser error, a slow head, a connection over a cap.
        errors: how those answers look (the worker node's JSON by default).

    Returns:
        The factory to give ``loop.create_server``.
    """
    return ConnectionFactory(manager, limits, on_error, errors)

