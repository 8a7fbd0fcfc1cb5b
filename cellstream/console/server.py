"""The console's web server (aiohttp): its configuration, its lifecycle, and the checks every request passes.

Every page but the login page, the static files and ``/healthz`` needs a session; every POST but the
login needs the session's CSRF token, and any POST whose ``Origin`` is not the console's own is refused.
Pages are rendered on the server from Jinja2 templates (autoescaped); the only static files are the
console's own stylesheet and its license. ``/metrics`` answers a session or the token as a Bearer header.
Connections have the worker node's limits (:mod:`logstore.node.connections`: a header deadline, an idle
timeout, a cap in all and per client address, answered in plain text), and a body (a form, at most
``FORM_MAX_BYTES``) must arrive within ``body_timeout``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from cellstream.console import views
from cellstream.console.auth import COOKIE, SESSION, Sessions
from cellstream.console.catalog import EntryCatalog
from cellstream.console.jobs import JobRunner
from cellstream.errors import LoginThrottled
from indexer.runtime.dlq_store import STATUSES
from indexer.runtime.dlq_triage import DeadLetterQueue
from logstore.build_info import register_build_info
from logstore.errors import ConfigurationError, InvalidArgumentError
from logstore.jobs import JobStore
from logstore.net import is_loopback
from logstore.node.connections import ErrorStyle, Limits, protocol_factory, text_document, track_requests
from logstore.node.guard import AuthLimits, HostAllowList, check_token, cross_site, retry_after
from logstore.tls import server_context

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = ("/login", "/static/", "/healthz")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
FORM_MAX_BYTES = 64 << 10  # the console's forms: a login, a filter, a reason; a larger body is answered 413
TEXT_ERRORS = ErrorStyle("console", "text/plain", text_document)


class ConsoleConfig(BaseModel):
    """How the console listens and who may use it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8090, ge=0, le=65535, description="0 picks a free port")
    token: SecretStr | None = Field(None, description="asked at login; without one, loopback binds only")
    session_ttl: float = Field(8 * 3600.0, gt=0, description="seconds a session may stay idle")
    page_size: int = Field(50, ge=1, le=1000, description="entries per page of the list")
    tls_cert: Path | None = Field(None, description="PEM certificate (chain) to serve HTTPS with")
    tls_key: Path | None = Field(None, description="its PEM private key")
    allowed_hosts: tuple[str, ...] | None = Field(
        None, description="Host names the console answers besides IP addresses and localhost ('*': any); "
                          "default: any with a token, none without")
    auth_limits: AuthLimits = Field(default_factory=AuthLimits, description="wrong tokens taken")
    header_timeout: float = Field(10.0, gt=0, description="seconds for a request's head (and a TLS handshake)")
    body_timeout: float = Field(30.0, gt=0, description="seconds for a request's body (a form)")
    idle_timeout: float = Field(60.0, gt=0, description="seconds a kept-alive connection may idle")
    max_connections: int = Field(1024, ge=1, description="connections at once; more are answered 503")
    max_connections_per_client: int = Field(64, ge=1, description="connections at once from one client address "
                                                                   "(an IPv6 /64); more are answered 503")

    @model_validator(mode="after")
    def _consistent(self) -> ConsoleConfig:
        if self.token is not None:
            check_token(self.token.get_secret_value(), "the console token")
        if self.token is None and not is_loopback(self.host):
            raise ValueError(f"--bind {self.host}: without a token the console listens only on loopback "
                             "(set CELLSTREAM_CONSOLE_TOKEN or --token-file)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        return self

    def tls_context(self) -> ssl.SSLContext | None:
        return None if self.tls_cert is None else server_context(self.tls_cert, self.tls_key)


class ConsoleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("cellstream_console_requests_total", "console requests answered",
                                ["route", "method", "status"], registry=registry)
        self.entries = Gauge("cellstream_console_dead_letters", "dead letters the console sees, by app and status",
                             ["app", "status"], registry=registry)
        self.job_entries = Counter("cellstream_console_job_entries_total",
                                   "entries worked through by console jobs, by kind and the entry's state after",
                                   ["kind", "after"], registry=registry)
        self.logins = Counter("cellstream_console_logins_total", "console logins, by result: ok, refused (a wrong "
                              "token or no name), throttled (too many wrong tokens, at the login or /metrics)",
                              ["result"],
                              registry=registry)
        self.refused = Counter("cellstream_console_connection_errors_total",
                               "requests answered before reaching a route, by status and reason: unparsable (400), "
                               "a head too slow (408), over the connection limit or the limit per client (503)",
                               ["status", "reason"], registry=registry)


class Console:
    """The dead-letter console of several apps (``{app name: its DeadLetterQueue}``), and the job records
    (long operations: compaction...) of ``job_store`` (default: the first app's store); start/stop idempotent,
    also an async context manager. ``url`` once started."""

    def __init__(self, queues: Mapping[str, DeadLetterQueue], config: ConsoleConfig, *, store_label: str = "",
                 registry: CollectorRegistry | None = None, job_store: JobStore | None = None) -> None:
        if not queues:
            raise InvalidArgumentError("the console needs at least one app or connector")
        self.config = config
        self.queues = dict(queues)
        # The console shows and steers the records; it runs no store job (a runner does: `cellstream jobs`).
        self.store_jobs = job_store or JobStore(next(iter(self.queues.values())).deadletters.store)
        self.store_label = store_label  # shown in the header; already redacted by the caller
        self.catalog = EntryCatalog({name: q.deadletters for name, q in self.queues.items()})
        self.sessions = Sessions(config.token.get_secret_value() if config.token else None, config.session_ttl,
                                 limits=config.auth_limits)
        self._hosts = HostAllowList(config.host, config.allowed_hosts, authenticated=config.token is not None)
        self.metrics = ConsoleMetrics(registry or CollectorRegistry())
        if registry is None:
            register_build_info(self.metrics.registry, "console")
        self.jobs = JobRunner(self.queues, self._job_progress)
        self._views = views.Views(self)
        self._refresh_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._state = "new"

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self._state != "new":
            return
        self._state = "starting"
        await self.refresh()  # the first read of every DLQ shard, before the first page asks
        self._runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await self._runner.setup()
        assert self._runner.server is not None
        # The worker node's connections: header deadline, idle timeout, connection caps (in all and per client).
        config = self.config
        limits = Limits(config.header_timeout, config.idle_timeout, config.max_connections,
                        linger=min(2.0, config.body_timeout),
                        max_connections_per_client=config.max_connections_per_client)
        factory = protocol_factory(self._runner.server, limits, self._connection_error, errors=TEXT_ERRORS)
        tls = config.tls_context()
        try:
            self._server = await asyncio.get_running_loop().create_server(
                factory, config.host, config.port, ssl=tls, reuse_address=True,
                ssl_handshake_timeout=config.header_timeout if tls else None)
        except OSError as exc:
            await self._runner.cleanup()
            where = f"{self.config.host}:{self.config.port}"
            raise ConfigurationError(f"cannot listen on {where}: {exc.strerror}") from None
        self._state = "running"
        logger.info("console on %s for %s (%d dead letters)", self.url, ", ".join(self.catalog.apps),
                    len(self.catalog))

    async def stop(self) -> None:
        if self._state in ("stopped", "new"):
            self._state = "stopped"
            return
        self._state = "stopped"
        await self.jobs.stop()
        server, self._server = self._server, None
        if server is not None:
            server.close()  # no new connections; the runner's cleanup closes the open ones
        if self._runner is not None:
            await self._runner.cleanup()
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Console:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        scheme = "https" if self.config.tls_cert else "http"
        shown = f"[{host}]" if ":" in host else host
        return f"{scheme}://{shown}:{port}"

    async def refresh(self) -> None:
        """Read the dead letters added since the last look (every page does, so it shows what its request
        follows: a replay's result, an entry dead-lettered a moment ago)."""
        async with self._refresh_lock:
            await asyncio.to_thread(self.catalog.refresh)

    def _connection_error(self, status: int, reason: str) -> None:
        self.metrics.refused.labels(str(status), reason).inc()

    def _job_progress(self, kind: str, after: str) -> None:
        self.metrics.job_entries.labels(kind, after).inc()

    # -- the application ----------------------------------------------------------
    def application(self) -> web.Application:
        app = web.Application(middlewares=[track_requests, self._headers, self._read_body, self._authenticate],
                              client_max_size=FORM_MAX_BYTES)
        self._views.routes(app)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})  # answered without a session: it tells nothing else

    async def _metrics(self, _request: web.Request) -> web.Response:
        # Read and counted at the scrape, rather than at every refresh a page makes (a pass over every entry):
        # the figures are current even when nobody has the console open.
        await self.refresh()
        counts = collections.Counter((e.app, e.status) for e in self.catalog.snapshot())
        for app in self.catalog.apps:
            for status in STATUSES:
                self.metrics.entries.labels(app, status).set(counts[(app, status)])
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    @web.middleware
    async def _headers(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        method = request.method if request.method in METHODS else "other"  # clients cannot add series
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            self._secure(exc.headers)
            self.metrics.requests.labels(route, method, str(exc.status)).inc()
            raise
        self._secure(response.headers)
        self.metrics.requests.labels(route, method, str(response.status)).inc()
        logger.debug("%s %s %d %.1f ms", request.method, route, response.status,
                     (time.perf_counter() - started) * 1000)
        return response

    @web.middleware
    async def _read_body(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # Every body is a form read whole by the checks or the page: read here, within the deadline, so that a
        # client trickling one holds its connection body_timeout at most (over FORM_MAX_BYTES: 413).
        if request.body_exists:
            try:
                await asyncio.wait_for(request.read(), self.config.body_timeout)
            except TimeoutError:
                response = web.Response(status=408, text=f"the request's body did not arrive within "
                                                         f"{self.config.body_timeout:g} s")
                response.force_close()  # the rest of the body may still come: not worth reading
                return response
        return await handler(request)

    @staticmethod
    def _secure(headers: MutableMapping[str, str]) -> None:
        # No script runs anywhere in the console; a framed or sniffed page is an attack, never a use.
        headers.setdefault("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; "
                                                      "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
        headers.setdefault("X-Content-Type-Options", "nosniff")
        headers.setdefault("Referrer-Policy", "same-origin")
        headers.setdefault("Cache-Control", "no-store")

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if not self._hosts.allows(request.host):
            # After DNS rebinding a page of another site reaches a loopback console under that site's name.
            raise web.HTTPForbidden(text=f"this console does not answer for Host {request.host[:100]!r} "
                                         "(cellstream console --allow-host NAME)")
        if request.method not in ("GET", "HEAD") and not self._same_origin(request):
            raise web.HTTPForbidden(text="cross-origin form posts are refused")
        if path.startswith(OPEN_PATHS):
            return await handler(request)
        if path == "/metrics" and self._scraper(request):
            return await handler(request)  # a scraper: the token as a Bearer header (or none is configured)
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            if request.method in ("GET", "HEAD"):
                back = urllib.parse.urlencode({"next": str(request.rel_url)})  # its own query string whole
                raise web.HTTPSeeOther(f"/login?{back}" if path != "/" else "/login")
            raise web.HTTPForbidden(text="log in first: your session has ended")
        if request.method == "POST":
            form = await request.post()
            value = form.get("csrf")
            if not isinstance(value, str) or not self.sessions.csrf_ok(session, value):
                raise web.HTTPForbidden(text="this form has expired (its CSRF token does not match your session): "
                                             "go back, reload the page and try again")
        request[SESSION] = session
        return await handler(request)

    def _scraper(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization")
        if header is None:
            return self.sessions.bearer_ok(None)
        try:
            return self.sessions.bearer_ok(header, request.remote or "")
        except LoginThrottled as exc:
            self.metrics.logins.labels("throttled").inc()
            raise web.HTTPTooManyRequests(text=str(exc), headers={"Retry-After": retry_after(exc.wait)}) from None

    @staticmethod
    def _same_origin(request: web.Request) -> bool:
        # Browsers send Origin and Sec-Fetch-Site with every POST; a client that sends neither is not a browser
        # tricked by a page.
        return cross_site(request.headers.get("Origin"), request.headers.get("Sec-Fetch-Site"),
                          f"{request.scheme}://{request.host}") is None
