"""The console's web server (aiohttp): its configuration, its lifecycle, and the checks every request passes.

Every page but the login page, the static files and ``/healthz`` needs a session; every POST but the
login needs the session's CSRF token, and any POST whose ``Origin`` is not the console's own is refused.
Pages are rendered on the server from Jinja2 templates (autoescaped); the only static files are the
console's own stylesheet and its license. ``/metrics`` answers a session or the token as a Bearer header.
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
from indexer.runtime.dlq_store import STATUSES
from indexer.runtime.dlq_triage import DeadLetterQueue
from logstore.build_info import register_build_info
from logstore.errors import ConfigurationError, InvalidArgumentError
from logstore.net import is_loopback
from logstore.tls import server_context

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = ("/login", "/static/", "/healthz")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


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

    @model_validator(mode="after")
    def _consistent(self) -> ConsoleConfig:
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
        self.logins = Counter("cellstream_console_logins_total", "console logins, by result", ["result"],
                              registry=registry)


class Console:
    """The dead-letter console of several apps (``{app name: its DeadLetterQueue}``); start/stop idempotent,
    also an async context manager. ``url`` once started."""

    def __init__(self, queues: Mapping[str, DeadLetterQueue], config: ConsoleConfig, *, store_label: str = "",
                 registry: CollectorRegistry | None = None) -> None:
        if not queues:
            raise InvalidArgumentError("the console needs at least one app or connector")
        self.config = config
        self.queues = dict(queues)
        self.store_label = store_label  # shown in the header; already redacted by the caller
        self.catalog = EntryCatalog({name: q.deadletters for name, q in self.queues.items()})
        self.sessions = Sessions(config.token.get_secret_value() if config.token else None, config.session_ttl)
        self.metrics = ConsoleMetrics(registry or CollectorRegistry())
        if registry is None:
            register_build_info(self.metrics.registry, "console")
        self.jobs = JobRunner(self.queues, self._job_progress)
        self._views = views.Views(self)
        self._refresh_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._state = "new"

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self._state != "new":
            return
        self._state = "starting"
        await self.refresh()  # the first read of every DLQ shard, before the first page asks
        self._runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.config.host, self.config.port,
                                 ssl_context=self.config.tls_context())
        try:
            await self._site.start()
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
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> Console:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        assert self._site is not None and self._runner is not None, "not started"
        host, port = self._runner.addresses[0][:2]
        scheme = "https" if self.config.tls_cert else "http"
        shown = f"[{host}]" if ":" in host else host
        return f"{scheme}://{shown}:{port}"

    async def refresh(self) -> None:
        """Read the dead letters added since the last look (every page does, so it shows what its request
        follows: a replay's result, an entry dead-lettered a moment ago)."""
        async with self._refresh_lock:
            await asyncio.to_thread(self.catalog.refresh)

    def _job_progress(self, kind: str, after: str) -> None:
        self.metrics.job_entries.labels(kind, after).inc()

    # -- the application ----------------------------------------------------------
    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._headers, self._authenticate], client_max_size=1 << 20)
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
        if request.method == "POST" and not self._same_origin(request):
            raise web.HTTPForbidden(text="cross-origin form posts are refused")
        if path.startswith(OPEN_PATHS):
            return await handler(request)
        if path == "/metrics" and self.sessions.bearer_ok(request.headers.get("Authorization")):
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

    @staticmethod
    def _same_origin(request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        # Browsers send Origin on every POST; a client that sends none is not a browser tricked by a page.
        return origin is None or origin == f"{request.scheme}://{request.host}"
