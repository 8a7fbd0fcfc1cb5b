"""The worker node: the logstore API over HTTP (aiohttp), in front of the storage nodes.

Stateless: it holds a :class:`~logstore.store.Store` and runs its blocking calls in a bounded thread pool,
so one slow storage node ties up threads, never the event loop. Every route, its models and its answer are
in :mod:`logstore.node.routes` (the server validates from them, :mod:`logstore.node.openapi` writes
``/openapi.json``); JSON in and out (:mod:`logstore.node.wire`). Every route but ``/healthz`` and
``/readyz`` needs the token when one is configured, ``_`` columns the admin token; without a token the node
binds to loopback only. Bad input is a 400 naming the field, a storage node that is down a 503 (retriable),
an unexpected failure a 500 that says only that: always a JSON document, never a traceback. The routes,
auth, limits and metrics in full: docs/worker-node.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import HttpVersion10, HttpVersion11, web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError, model_validator

from logstore.build_info import register_build_info
from logstore.errors import (
    ConfigurationError,
    IndexInactiveError,
    IndexUnknownError,
    InvalidArgumentError,
    InvalidConditionError,
    LogstoreError,
)
from logstore.index_tables.query import index_info, index_names, query_index
from logstore.jobs import JobRecordsCollector, JobStore
from logstore.net import is_loopback
from logstore.node import openapi, wire
from logstore.node.connections import Connection, Limits, protocol_factory
from logstore.node.guard import AuthLimits, AuthThrottle, HostAllowList, check_token, cross_site, retry_after
from logstore.node.health import CachedCollector, NodeHealth
from logstore.node.models import models
from logstore.node.routes import ROUTES, Route, methods_of
from logstore.persistence import TruncatedPage
from logstore.store import Store
from logstore.tls import server_context

logger = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})  # others are "other" in metrics


class ServerConfig(BaseModel):
    """How a worker node listens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535, description="0 picks a free port")
    token: SecretStr | None = Field(None, description="required as a Bearer token on every request when set")
    admin_token: SecretStr | None = Field(None, description="the Bearer token for /v1/system/cells (and the rest)")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies get 413")
    threads: int = Field(8, ge=1, le=512, description="blocking store calls at once (the MySQL pool holds 8)")
    replay_interval: float = Field(1.0, gt=0, description="seconds between passes of the buffered-write replayer")
    health_interval: float = Field(1.0, gt=0, description="seconds between the background checks of the storage "
                                                          "nodes that /readyz and /metrics report")
    health_timeout: float = Field(0.5, gt=0, le=5.0, description="a storage node whose check has not answered in "
                                  "this many seconds is reported down; the longest /readyz waits for one")
    header_timeout: float = Field(10.0, gt=0, description="seconds for a request's head (and a TLS handshake)")
    body_timeout: float = Field(30.0, gt=0, description="seconds for a request's body")
    idle_timeout: float = Field(60.0, gt=0, description="seconds a kept-alive connection may idle")
    max_connections: int = Field(1024, ge=1, description="connections at once; more are answered 503")
    max_connections_per_client: int = Field(
        64, ge=1, description="connections at once from one client address (an IPv6 /64); more are answered 503")
    tls_cert: Path | None = Field(None, description="PEM certificate (chain) to serve HTTPS with")
    tls_key: Path | None = Field(None, description="its PEM private key")
    allowed_hosts: tuple[str, ...] | None = Field(
        None, description="Host names the node answers besides IP addresses and localhost ('*': any); default: "
                          "any with a token, none without")
    auth_limits: AuthLimits = Field(default_factory=AuthLimits, description="failed token attempts taken")

    @model_validator(mode="after")
    def _consistent(self) -> ServerConfig:
        for name, value in (("the token", self.token), ("the admin token", self.admin_token)):
            if value is not None:
                check_token(value.get_secret_value(), name)
        if self.admin_token is not None and self.token is None:
            raise ValueError("an admin token needs a token: without one every route is open anyway")
        if self.admin_token is not None and self.token is not None and \
                self.admin_token.get_secret_value() == self.token.get_secret_value():
            raise ValueError("the admin token must differ from the token")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        return self

    def tls_context(self) -> ssl.SSLContext | None:
        return None if self.tls_cert is None else server_context(self.tls_cert, self.tls_key)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("cellstream_worker_requests_total", "HTTP requests answered",
                                ["route", "method", "status"], registry=registry)
        self.seconds = Histogram("cellstream_worker_request_seconds", "time to answer a request", ["route"],
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
                                 registry=registry)
        self.cells = Counter("cellstream_worker_cells_written_total", "cells written through the node",
                             registry=registry)
        self.replayed = Counter("cellstream_worker_buffered_cells_replayed_total",
                                "buffered cells written home by this node's replayer", registry=registry)
        self.pending = Gauge("cellstream_worker_buffered_cells_waiting",
                             "buffered cells waiting for their primary, after the last replay pass", registry=registry)
        self.connections = Gauge("cellstream_worker_connections", "client connections open", registry=registry)
        self.storage_up = Gauge("cellstream_worker_storage_node_up",
                                "1 when the storage node answered the worker node's last check (made in the "
                                "background every second, and by each /readyz) within its timeout", ["node"],
                                registry=registry)
        self.node_shards = Gauge("cellstream_worker_storage_node_shards",
                                 "shards the shard map places on each storage node, as this node last read it",
                                 ["node"], registry=registry)
        self.map_version = Gauge("cellstream_worker_shard_map_version",
                                 "the version of the shard map this node follows (0: the cluster file's)",
                                 registry=registry)
        self.guarded = Counter("cellstream_worker_requests_refused_total",
                               "requests refused before their route: a Host not allowed (host), sent by another "
                               "site's page (origin), a wrong or missing token (token), too many wrong tokens "
                               "from the client or from all (throttled)", ["reason"], registry=registry)
        self.refused = Counter("cellstream_worker_connection_errors_total",
                               "requests answered before reaching a route: unparsable (400), too slow (408), "
                               "over the connection limit or the client's share of it (503); the reason says which",
                               ["status", "reason"], registry=registry)


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=wire.dumps(doc), status=status, content_type="application/json")


class WorkerNode:
    """One worker node serving ``store``. ``start()``/``stop()`` are safe twice; ``async with`` works."""

    def __init__(self, store: Store, config: ServerConfig | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.config = config or ServerConfig()
        if self.config.token is None and not is_loopback(self.config.host):
            raise ConfigurationError(f"no token configured: the worker node binds only to loopback, "
                                     f"not {self.config.host} (set a token to listen there)")
        self._tls = self.config.tls_context()
        self._hosts = HostAllowList(self.config.host, self.config.allowed_hosts,
                                    authenticated=self.config.token is not None)
        self._throttle = AuthThrottle(self.config.auth_limits)
        # The admin token first: it is the one that holds every right.
        self._tokens = {name: value.get_secret_value().encode() for name, value in
                        (("admin", self.config.admin_token), ("token", self.config.token)) if value is not None}
        self.metrics = _Metrics(registry or CollectorRegistry())
        if registry is None:
            register_build_info(self.metrics.registry, "worker-node")
        # The store's jobs, as their records have them: a job whose runner died is seen here, where an
        # operator's Prometheus already scrapes (the alerts on failed and runner-less jobs read these). Read in
        # the background: the jobs shard's node may be the one that does not answer.
        jobs = CachedCollector(JobRecordsCollector(JobStore(store)))
        self.metrics.registry.register(jobs)
        self.health = NodeHealth(store, interval=self.config.health_interval, timeout=self.config.health_timeout,
                                 on_round=self._report_nodes, cached=[jobs])
        self.metrics.connections.set_function(self._open_connections)
        self._pool: ThreadPoolExecutor | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._port = self.config.port
        self._replayer: asyncio.Task[None] | None = None
        self._reported: set[str] = set()  # the storage nodes the metrics name
        self._models = models(store.shard_count)
        self._openapi = wire.dumps(openapi.document(store.shard_count))
        self._routes: dict[tuple[str, str], Route] = {(m, r.path): r for r in ROUTES for m in methods_of(r)}
        # Marks of the cell counts are this process's: a restarted node answers an old one with every count.
        self._instance = uuid.uuid4().hex[:16]

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self.config.host}:{self._port}"

    # -- lifecycle ------------------------------------------------------------------
    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors, self._guard, self._auth])
        for route in ROUTES:
            endpoint = self._endpoint(route)
            for method in methods_of(route):  # HEAD wherever GET: the same route, aiohttp leaves out the body
                app.router.add_route(method, router_path(route.path, [r.path for r in ROUTES]), endpoint,
                                     expect_handler=_continue_later)
        return app

    def _endpoint(self, route: Route) -> Handler:
        """The route's handler behind validation of its path, query and body by the route's models."""
        handler: Callable[[Got], Awaitable[web.StreamResponse]] = getattr(self, route.handler)
        built = self._models

        def adapter(name: str | None) -> TypeAdapter[Any] | None:
            return None if name is None else TypeAdapter(getattr(built, name))

        path, query, body = adapter(route.path_model), adapter(route.query_model), adapter(route.body_model)
        known = ", ".join(getattr(built, route.query_model).model_fields) if route.query_model else ""

        async def endpoint(request: web.Request) -> web.StreamResponse:
            shards = self.store.shard_count
            _check_framing(request, body is not None, self.config.max_body_bytes)
            got_path = _validated(path, dict(request.match_info), "path", shards) if path else None
            if query is None and request.query:
                raise _BadInput(next(iter(request.query)), "unknown query parameter (this route takes none)")
            if len(set(request.query)) != len(request.query):  # ?limit=1&limit=2: which one was meant?
                twice = next(k for k in request.query if len(request.query.getall(k)) > 1)
                raise _BadInput(twice, "given more than once")
            got_query = _validated(query, dict(request.query), "query", shards, known) if query else None
            got_body = None
            if body is not None:
                got_body = _validated(body, await _json_body(request, self.config.body_timeout), "body", shards)
            return await handler(Got(request, route, got_path, got_query, got_body))

        return endpoint

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="worker-node")
        runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await runner.setup()
        assert runner.server is not None
        limits = Limits(self.config.header_timeout, self.config.idle_timeout, self.config.max_connections,
                        linger=min(2.0, self.config.body_timeout),
                        max_connections_per_client=self.config.max_connections_per_client)
        factory = protocol_factory(runner.server, limits, self._connection_error)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(factory, self.config.host, self.config.port, ssl=self._tls,
                                                    reuse_address=True,
                                                    ssl_handshake_timeout=self.config.header_timeout
                                                    if self._tls else None)
        except OSError as exc:
            await runner.cleanup()
            self._pool.shutdown(wait=False)
            self._pool = None
            where = f"{self.config.host}:{self.config.port}"
            raise ConfigurationError(f"cannot listen on {where}: {exc.strerror}") from None
        self._runner = runner
        self._port = self._server.sockets[0].getsockname()[1]  # the port bound when 0 was asked for
        await self._warm()
        await self.health.start()
        if self.store.buffers_writes:
            self._replayer = asyncio.create_task(self._replay(), name="worker-node-replayer")
        access = ("token required" + (", admin token for system cells" if self.config.admin_token else "")
                  if self.config.token else "no token: loopback only, unauthenticated")
        logger.info("worker node on %s (%s)", self.url, access)

    def _open_connections(self) -> float:
        runner = self._runner
        return float(len(runner.server.connections)) if runner is not None and runner.server is not None else 0.0

    def _connection_error(self, status: int, reason: str) -> None:
        self.metrics.refused.labels(str(status), reason).inc()

    async def _warm(self) -> None:
        """Open the pool's connections now, not on the first requests (a MySQL connect takes far longer than
        a read). Best effort: a storage node that does not answer is /readyz's to report."""
        n = min(self.config.threads, self.store.options.pool_size)
        together = threading.Barrier(n)

        def warm(shard: int) -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait(timeout=2)  # all at once, so each takes its own connection
            with contextlib.suppress(LogstoreError):
                self.store.head(shard)

        for shard in self._first_shards().values():
            together.reset()
            await asyncio.gather(*(self._call(warm, shard) for _ in range(n)))

    async def _replay(self) -> None:
        """Write buffered cells home while their primaries answer again (Store.replay_pending), forever."""
        while True:
            await asyncio.sleep(self.config.replay_interval)
            try:
                report = await self._call(self.store.replay_pending)
            except LogstoreError as exc:
                logger.warning("buffered-write replay pass failed: %s", exc)
                continue
            self.metrics.replayed.inc(report.replayed)
            self.metrics.pending.set(report.waiting)
            if report.replayed or report.failed:
                logger.info("replayed %d buffered cells home (%d failed, %d waiting)", report.replayed,
                            report.failed, report.waiting)

    async def stop(self) -> None:
        await self.health.stop()
        replayer, self._replayer = self._replayer, None
        if replayer is not None:
            replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replayer
        server, self._server = self._server, None
        if server is not None:
            server.close()  # no new connections; the runner's cleanup closes the open ones
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if server is not None:
            await server.wait_closed()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    async def __aenter__(self) -> WorkerNode:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # -- middlewares ----------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        connection = request.protocol
        if isinstance(connection, Connection):
            connection.request_started()
        try:
            if request.method == "CONNECT":
                await _no_tunnel(request)
            response = await handler(request)
        except LogstoreError as exc:
            response = _json(wire.error_json(exc), wire.error_status(exc))
            if exc.retriable:
                response.headers["Retry-After"] = "1"
        except _BadInput as exc:
            response = _json(wire.bad_request(exc.field, exc.problem, exc.kind), 400)
        except _NotJSON as exc:
            response = _json(wire.error("UnsupportedMediaType", str(exc)), 415)
        except _SlowBody as exc:
            response = _json(wire.error("RequestTimeout", str(exc)), 408)
            response.force_close()
        except _Refused as exc:
            response = _json(exc.document(), exc.status)
            if exc.close:
                response.force_close()
        except _Throttled as exc:
            response = _json(wire.error("TooManyFailedTokens", str(exc)), 429)
            response.headers["Retry-After"] = retry_after(exc.wait)
        except web.HTTPException as exc:
            message = exc.reason
            if isinstance(exc, web.HTTPMethodNotAllowed):
                message = f"{exc.method} is not a method of this route: {', '.join(sorted(exc.allowed_methods))}"
            response = _json(wire.error("HTTPError", message), exc.status)
            for name in ("WWW-Authenticate", "Allow"):
                if name in exc.headers:
                    response.headers[name] = exc.headers[name]
        except Exception:
            logger.exception("worker node: %s %s failed", request.method, request.path)
            response = _json(wire.error("InternalError", "the worker node failed unexpectedly; its log says why"), 500)
        finally:
            if isinstance(connection, Connection):
                connection.request_finished()
        method = request.method if request.method in METHODS else "other"
        self.metrics.requests.labels(route, method, str(response.status)).inc()
        self.metrics.seconds.labels(route).observe(time.perf_counter() - started)
        return response

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Requests not meant for this node (another Host: DNS rebinding) or sent by a web page: refused."""
        host = request.headers.get("Host")
        if not self._hosts.allows(host):
            self.metrics.guarded.labels("host").inc()
            raise web.HTTPForbidden(reason=f"this worker node does not answer for Host {str(host)[:100]!r} "
                                           "(cellstream serve --allow-host NAME)")
        why = cross_site(request.headers.get("Origin"), request.headers.get("Sec-Fetch-Site"),
                         f"{request.scheme}://{request.host}")
        if why is not None:
            self.metrics.guarded.labels("origin").inc()
            raise web.HTTPForbidden(reason=f"the worker node takes no requests from web pages: this one was {why}")
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        token, admin = self.config.token, self.config.admin_token
        resource = request.match_info.route.resource
        route = self._routes.get((request.method, resource.canonical)) if resource is not None else None
        access = route.access if route is not None else "token"
        if token is None or access == "open" or await self._open_405(request):
            return await handler(request)
        held = self._token_held(request)
        if held is None:
            raise web.HTTPUnauthorized(reason="a valid Authorization: Bearer token is required",
                                       headers={"WWW-Authenticate": 'Bearer realm="cellstream"'})
        if access == "admin" and held != "admin":
            raise web.HTTPForbidden(reason=_admin_only(route, admin is not None))
        return await handler(request)

    async def _open_405(self, request: web.Request) -> bool:
        """Whether the request is a method an open route lacks (POST /healthz): its 405 needs no token, where a 401
        would say a token could make it work."""
        refused = request.match_info.http_exception
        if not isinstance(refused, web.HTTPMethodNotAllowed) or not refused.allowed_methods:
            return False
        found = await request.app.router.resolve(request.clone(method=sorted(refused.allowed_methods)[0]))
        resource = found.route.resource
        return resource is not None and all(
            (r := self._routes.get((method, resource.canonical))) is not None and r.access == "open"
            for method in refused.allowed_methods)

    def _token_held(self, request: web.Request) -> str | None:
        """Which token the request presents (``"token"`` or ``"admin"``), None for none or a wrong one.

        Raises:
            _Throttled: the client, or every client, made too many wrong attempts: not compared at all.
        """
        wait, held = self._throttle.attempt(request.remote or "", _bearer(request), self._tokens)
        if wait > 0:
            self.metrics.guarded.labels("throttled").inc()
            raise _Throttled(wait)
        if held is None:
            self.metrics.guarded.labels("token").inc()
        return held

    # -- service --------------------------------------------------------------------
    async def healthz(self, got: Got) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(self, got: Got) -> web.Response:
        nodes = await self.health.check()  # at most health_timeout: a node that has not answered by then is down
        ready = all(v == "ok" for v in nodes.values())
        if not self._holds_a_token(got.request):  # an open route: what a storage node answered names its host
            nodes = {node: "ok" if answer == "ok" else "unavailable" for node, answer in nodes.items()}
        return _json({"ready": ready, "nodes": nodes}, 200 if ready else 503)

    def _holds_a_token(self, request: web.Request) -> bool:
        """Whether the request carries this node's token or admin token (always, for a node without a token).
        A guess here counts as one on any route: the detail it unlocks would otherwise tell a right guess."""
        if self.config.token is None:
            return True
        if not _bearer(request):
            return False
        try:
            return self._token_held(request) is not None
        except _Throttled:
            return False

    def _first_shards(self) -> dict[str, int]:
        """A shard of each storage node that holds one, by the shard map as it is now (nodes join and leave)."""
        return {node: shard for shard, node in reversed(list(enumerate(self.store.placement())))}

    def _report_nodes(self, nodes: dict[str, str]) -> None:
        """The gauges of the storage nodes, from their checks' answers (``{node: "ok" or why not}``); a node that
        left the map is dropped from them."""
        shards: dict[str, int] = {}
        for holder in self.store.placement():
            shards[holder] = shards.get(holder, 0) + 1
        for node, answer in nodes.items():
            self.metrics.storage_up.labels(node).set(int(answer == "ok"))
            self.metrics.node_shards.labels(node).set(shards.get(node, 0))
        for gone in self._reported - set(nodes):
            self.metrics.storage_up.remove(gone)
            self.metrics.node_shards.remove(gone)
        self._reported = set(nodes)
        self.metrics.map_version.set(self.store.shard_map.version)

    async def prometheus(self, got: Got) -> web.Response:
        # On the event loop, not the request threads (all of them may wait on a node that hangs): every value is
        # in memory, kept by the background checks (NodeHealth).
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, got: Got) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def info(self, got: Got) -> web.Response:
        return _json({"shards": self.store.shard_count, "nodes": self.store.nodes,
                      "max_body_bytes": self.config.max_body_bytes})

    # -- cells ----------------------------------------------------------------------
    async def put_cells(self, got: Got) -> web.Response:
        cells = [(c.row_key, c.column, c.ref_key, c.body) for c in got.body.cells]
        put = self.store.put_system_cells if got.route.access == "admin" else self.store.put_cells
        stored = await self._call(put, cells)
        self.metrics.cells.inc(len(stored))
        return _json({"cells": [c.to_json() for c in stored]})

    put_system_cells = put_cells

    async def put_cell(self, got: Got) -> web.Response:
        at = got.path
        cell = await self._call(self.store.put_cell, at.row_key, at.column, at.ref_key, got.body)
        self.metrics.cells.inc()
        return _json(cell.to_json())

    async def get_cell(self, got: Got) -> web.Response:
        at = got.path
        cell = await self._call(self.store.get_cell, at.row_key, at.column, at.ref_key)
        if cell is None:
            return _not_found("no cell at these coordinates")
        return _json(cell.to_json())

    async def get_latest(self, got: Got) -> web.Response:
        cell = await self._call(self.store.get_cell_latest, got.path.row_key, got.path.column, as_of=got.query.as_of)
        if cell is None:
            return _not_found("no cell in this row and column" + (" created by then" if got.query.as_of else ""))
        return _json(cell.to_json())

    async def get_row(self, got: Got) -> web.Response:
        row = await self._call(self.store.get_row, got.path.row_key, as_of=got.query.as_of)
        return _json({"cells": {column: cell.to_json() for column, cell in row.items()}})

    async def get_versions(self, got: Got) -> web.Response:
        query = got.query
        cells = await self._call(self.store.get_cell_versions, got.path.row_key, got.path.column,
                                 before=query.before, limit=query.limit)
        more = isinstance(cells, TruncatedPage) or len(cells) == query.limit
        answer: dict[str, Any] = {"cells": [c.to_json() for c in cells],
                                  "next": cells[-1].ref_key if cells and more else None}
        if isinstance(cells, TruncatedPage):
            answer["truncated"] = True
        return _json(answer)

    async def read_cells(self, got: Got) -> web.Response:
        # The answer's bodies hold to the store's budget of a log page: the store stops reading once it is spent.
        wanted = [(c.row_key, c.column, c.ref_key) for c in got.body.cells]
        budget = min(self.store.options.max_read_bytes, got.body.max_bytes or self.store.options.max_read_bytes)
        cells = await self._call(self.store.read_cells, wanted, as_of=got.body.as_of, max_bytes=budget)
        answer: dict[str, Any] = {"cells": [c.to_json() if c is not None else None for c in cells]}
        if isinstance(cells, TruncatedPage):
            answer["truncated"] = True
        return _json(answer)

    # -- shards and logs --------------------------------------------------------------
    async def shards(self, got: Got) -> web.Response:
        stats = await self._call(self.store.shard_stats)
        return _json({"shards": [{"shard": s.shard, "node": s.node, "cells": s.cells} for s in stats]})

    async def counts(self, got: Got) -> web.Response:
        since = None if got.query.since is None else wire.decode_mark(got.query.since, self._instance)
        answer = await self._call(self.store.changed_counts, since)
        return _json({"shards": list(answer.counts), "cells": list(answer.counts.values()),
                      "mark": wire.encode_mark(answer.mark, self._instance), "complete": answer.complete})

    async def shard(self, got: Got) -> web.Response:
        shard = got.path.shard
        head = await self._call(self.store.head, shard)
        return _json({"shard": shard, "node": self.store.node_of(shard), "head": head})

    async def log(self, got: Got) -> web.Response:
        query = got.query
        cells, next_location = await self._call(self.store.get_cells_for_shard, got.path.shard, query.after,
                                                query.limit, columns=_columns(query.columns))
        answer: dict[str, Any] = {"cells": [c.to_json() for c in cells], "next": next_location}
        if isinstance(cells, TruncatedPage):
            answer["truncated"] = True
        return _json(answer)

    async def count(self, got: Got) -> web.Response:
        count = await self._call(self.store.count_after, got.path.shard, got.query.after,
                                 columns=_columns(got.query.columns), reserved=got.query.reserved == "true")
        return _json({"count": count})

    async def location(self, got: Got) -> web.Response:
        return _json({"location": await self._call(self.store.location_at, got.path.shard, got.query.at)})

    async def logs(self, got: Got) -> web.Response:
        query = got.body
        locations = {int(k): v for k, v in query.locations.items()}
        pages = await self._call(self.store.get_cells_for_shards, locations, query.limit, columns=query.columns)
        out: dict[str, Any] = {}
        for shard, page in pages.items():
            if isinstance(page, LogstoreError):
                out[str(shard)] = wire.error_json(page)
            else:
                out[str(shard)] = {"cells": [c.to_json() for c in page]}
                if isinstance(page, TruncatedPage):  # cut short by the answer's byte budget: read on after it
                    out[str(shard)]["truncated"] = True
        return _json({"pages": out})

    # -- buffered writes ----------------------------------------------------------------
    async def pending(self, got: Got) -> web.Response:
        # The clients of this node see no pending tables: what `cellstream pending --store http://...` shows.
        counts = await self._call(self.store.pending_counts)
        return _json({"held": {home: {holder: {"waiting": w, "failed": f} for holder, (w, f) in holders.items()}
                               for home, holders in counts.held.items()},
                      "unreachable": counts.unreachable})

    async def replay_pending(self, got: Got) -> web.Response:
        # A pass as the replayer's (the token suffices: it writes nothing the node would not write a second later).
        report = await self._call(self.store.replay_pending)
        self.metrics.replayed.inc(report.replayed)
        self.metrics.pending.set(report.waiting)
        return _json(report._asdict())

    # -- secondary indexes ------------------------------------------------------------
    async def list_indexes(self, got: Got) -> web.Response:
        def read() -> list[dict[str, Any]]:
            found = []
            for name in index_names(self.store):
                with contextlib.suppress(IndexUnknownError):  # tables without a catalog record: not served
                    found.append(index_info(self.store, name).to_json())
            return found
        return _json({"indexes": await self._call(read)})

    async def query_index(self, got: Got) -> web.Response:
        """What ``cellstream index query`` (``indexer.indexes.applier.Index.query``) gives, within the answer's byte
        budget (the store's max_read_bytes, as a log page): an answer cut short holds the first entries."""
        asked = got.body
        try:
            spec, entries = await self._call(query_index, self.store, got.path.name, asked.where, order=asked.order,
                                             limit=asked.limit, scatter=asked.scatter, version=asked.version)
        except IndexUnknownError as exc:  # a 404 typed, so that a client raises what a local store would
            return _json(wire.error(type(exc).__name__, str(exc)), 404)
        except IndexInactiveError as exc:
            return _json(wire.error(type(exc).__name__, str(exc)), 409)
        except InvalidConditionError as exc:
            raise _BadInput(exc.field if exc.field == "scatter" else f"where.{exc.field}", exc.problem,
                            type(exc).__name__) from None
        budget, used = self.store.options.max_read_bytes, 0
        answer: dict[str, Any] = {"index": spec.name, "version": spec.version, "entries": []}
        for entry in entries:
            doc = entry.to_json()
            used += len(wire.dumps(doc))
            if answer["entries"] and used > budget:
                answer["truncated"] = True
                break
            answer["entries"].append(doc)
        return _json(answer)

    # -- offsets --------------------------------------------------------------------
    async def consumers(self, got: Got) -> web.Response:
        return _json({"consumers": await self._call(self.store.consumers)})

    async def read_offsets(self, got: Got) -> web.Response:
        records = await self._call(self.store.read_offsets, got.path.consumer)
        return _json({"offsets": {str(s): r._asdict() for s, r in records.items()}})

    async def claim_offsets(self, got: Got) -> web.Response:
        records = await self._call(self.store.claim_offsets, got.path.consumer, got.body.owner, got.body.shards)
        return _json({"offsets": {str(s): r._asdict() for s, r in records.items()}})

    async def commit_offsets(self, got: Got) -> web.Response:
        offsets = {int(k): (v.location, v.doc) for k, v in got.body.offsets.items()}
        fenced = await self._call(self.store.commit_offsets, got.path.consumer, got.body.owner, offsets)
        return _json({"fenced": sorted(fenced)})


# -- input ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Got:
    """A request as its route's models validated it."""

    request: web.Request
    route: Route
    path: Any
    query: Any
    body: Any


class _BadInput(Exception):
    def __init__(self, field: str, problem: str, kind: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.kind = kind  # the error's type when not the one bad_request gives the field
        super().__init__(f"{field}: {problem}")


def _validated(adapter: TypeAdapter[Any], doc: Any, where: str, shards: int, known: str = "") -> Any:
    """``doc`` as ``adapter`` takes it, or _BadInput naming the first bad field as the request named it."""
    try:
        return adapter.validate_python(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        problem = first["msg"]
        if loc and loc[-1] == "[key]":  # only shard numbers key an object
            loc.pop()
            problem = f"not a shard: the shards are 0 to {shards - 1}, in ASCII digits without leading zeros"
        field = ".".join(loc) or where
        if first["type"] == "number_range":  # the place inside a body: the validator's context says it
            inside = str(first.get("ctx", {}).get("where", ""))
            field = field + ("" if inside.startswith("[") else ".") + inside if inside else field
            problem = problem.split(": ", 1)[-1]
        elif first["type"] == "extra_forbidden" and where == "query":
            problem = f"unknown query parameter (this route takes: {known or 'none'})"
        raise _BadInput(field, problem) from None


def _bearer(request: web.Request) -> bytes:
    """The Bearer token a request presents (empty without one)."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip().encode() if scheme.lower() == "bearer" else b""


def router_path(path: str, paths: list[str]) -> str:
    """``path`` for aiohttp's router: a parameter does not match the literal segment a sibling route has in its
    place (``/v1/rows/{row_key}/{column}/{ref_key}`` is not ``.../versions``), so a method only the literal's
    route lacks is a 405 there with that route's Allow, not a 400 for a ``ref_key`` nobody meant."""
    segments = path.split("/")
    out = []
    for i, segment in enumerate(segments):
        literals = sorted({other[i] for other in (p.split("/") for p in paths) if len(other) == len(segments)
                           and not other[i].startswith("{") and segment.startswith("{")
                           and all(other[j] == segments[j] for j in range(len(segments)) if j != i)})
        if literals:
            alternatives = "|".join(re.escape(literal) for literal in literals)
            segment = f"{segment[:-1]}:(?!(?:{alternatives})(?:/|$))[^{{}}/]+}}"
        out.append(segment)
    return "/".join(out)


async def _no_tunnel(request: web.Request) -> None:
    """CONNECT asks for a tunnel, which a worker node does not make; aiohttp's router, which knows no route for it
    (not even by a method the route lacks), said 404. A target naming a route is its 405, with its Allow.

    Raises:
        web.HTTPMethodNotAllowed: the target is a route's path.
        web.HTTPNotFound: it is not.
    """
    # aiohttp reads a CONNECT target as an authority (host:port): the path a client gave is the raw target
    target = request.raw_path
    if not target.startswith("/"):
        raise web.HTTPNotFound()
    found = await request.app.router.resolve(request.clone(method="GET", rel_url=target))
    refused = found.http_exception
    if isinstance(refused, web.HTTPMethodNotAllowed):  # a route without GET
        raise web.HTTPMethodNotAllowed("CONNECT", refused.allowed_methods)
    if refused is not None or found.route.resource is None:
        raise web.HTTPNotFound()
    raise web.HTTPMethodNotAllowed("CONNECT", {route.method for route in found.route.resource})


async def _continue_later(request: web.Request) -> None:
    """Every route's Expect handler: nothing at routing time. aiohttp's own sends ``100 Continue`` before
    the middlewares run, so a client without a token, or with a body too large, was told to send it;
    :func:`_json_body` says it once the request passed every check, :func:`_check_framing` refuses an
    expectation other than 100-continue (RFC 9110 10.1.1)."""
    return None


def _check_framing(request: web.Request, takes_body: bool, max_body_bytes: int) -> None:
    """Refuse, from its head alone, a request whose framing the route cannot serve: an HTTP version other
    than 1.0 and 1.1 (505), an expectation other than 100-continue (417), a body on a route that takes
    none (400: GET content has no meaning, and a proxy that disagrees could smuggle a request in it), a
    declared Content-Length over ``max_body_bytes`` (413, before a byte of it is read)."""
    if request.version not in (HttpVersion10, HttpVersion11):
        raise _Refused(505, "HTTPVersionNotSupported",
                       f"HTTP/{request.version.major}.{request.version.minor} is not served: HTTP/1.1 is", close=True)
    expect = request.headers.get("Expect")
    if expect is not None and expect.lower() != "100-continue":
        raise _Refused(417, "ExpectationFailed", f"Expect: {expect[:100]!r} cannot be met (only 100-continue)",
                       close=True)
    if not takes_body:
        if request.body_exists:
            raise _Refused(400, "InvalidArgumentError", f"{request.method} on this route takes no request body",
                           close=True, field="body")
    elif request.content_length is not None and request.content_length > max_body_bytes:
        raise _Refused(413, "HTTPError", f"the request's body ({request.content_length} bytes) is over the node's "
                                         f"limit of {max_body_bytes} bytes", close=True)


class _Refused(Exception):
    """A request refused with ``status``; ``close``: its body was not read, so the connection goes."""

    def __init__(self, status: int, kind: str, message: str, *, close: bool = False, field: str | None = None) -> None:
        self.status, self.kind, self.close, self.field = status, kind, close, field
        super().__init__(message)

    def document(self) -> dict[str, Any]:
        if self.field is not None:
            return wire.bad_request(self.field, str(self).removeprefix(f"{self.field}: "), self.kind)
        return wire.error(self.kind, str(self))


async def _json_body(request: web.Request, timeout: float) -> Any:
    # A browser sends text/plain or a form cross-site without asking first (no CORS preflight): only a body
    # labelled JSON is read, so no web page can write to a node on this machine.
    if request.content_type != "application/json":
        raise _NotJSON(request.content_type)
    if request.version >= HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        # Only now, every check of the head passed (auth, path, query, declared size): a client waiting for
        # the go-ahead is refused before it sends a byte of a body that would be refused anyway.
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not started (as aiohttp's own expect handler)
    try:
        raw = await asyncio.wait_for(request.read(), timeout)  # over client_max_size: 413
    except TimeoutError:
        raise _SlowBody(timeout) from None
    except (ConnectionResetError, RequestPayloadError) as exc:  # the client's doing: no traceback, no 500
        why = getattr(exc.__cause__, "message", None) or str(exc) or type(exc).__name__
        raise _Refused(400, "BadRequestBody", f"the request's body could not be read: {why}", close=True) from None
    if not raw:
        raise _BadInput("body", "a JSON document is required")
    try:
        return wire.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _BadInput("body", f"not JSON: {exc}") from None


class _Throttled(Exception):
    def __init__(self, wait: float) -> None:
        self.wait = wait
        super().__init__(f"too many wrong tokens from this client or from all: not checked; retry in {wait:.0f} s "
                         "with the right token")


def _admin_only(route: Route | None, node_has_admin: bool) -> str:
    what = ("claiming or committing a consumer's positions" if route is not None and "/offsets/" in route.path
            else "writing cellstream's own _ columns")
    if node_has_admin:
        return f"{what} needs the admin token"
    return f"this node takes no {what}: it has no admin token (cellstream serve --admin-token-file)"


class _NotJSON(Exception):
    def __init__(self, content_type: str) -> None:
        super().__init__(f"a request body must be sent as application/json, not {content_type}")


class _SlowBody(Exception):
    def __init__(self, timeout: float) -> None:
        super().__init__(f"the request's body did not arrive within {timeout:g} s")


def _columns(text: str | None) -> list[str] | None:
    return None if text is None else text.split(",")


def _not_found(message: str) -> web.Response:
    return _json(wire.error("NotFound", message), 404)


def check_bind(host: str, token: str | None) -> None:
    """The refusal ``cellstream serve`` prints before it opens anything."""
    if token is None and not is_loopback(host):
        raise InvalidArgumentError(f"--bind {host}: without a token the worker node listens only on loopback "
                                   "(set CELLSTREAM_TOKEN or --token-file)")
