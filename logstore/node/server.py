"""The worker node: the logstore API over HTTP (aiohttp), in front of the storage nodes.

Stateless: it holds a :class:`~logstore.store.Store` on the cluster file and runs its
blocking calls in a bounded thread pool, so one slow storage node ties up threads,
never the event loop. JSON in and out (:mod:`logstore.node.wire`); the OpenAPI document is
at ``/openapi.json`` (:mod:`logstore.node.openapi`).

- ``/healthz``: the process answers. ``/readyz``: every storage node answers (503
  naming the ones that do not). Both are open; everything else needs
  ``Authorization: Bearer <token>`` when a token is configured.
- Without a token the node refuses to bind anything but a loopback address.
- A request body over ``max_body_bytes`` gets 413; any bad input a 400 naming the
  field; an unknown path 404; a storage node that is down 503 (retriable). Errors are
  always a JSON document, never a traceback: an unexpected failure is logged here and
  answered with a 500 that says only that.
- ``/metrics``: requests by route and status, their latency, cells written, buffered cells.
- When the store buffers writes (a cluster whose nodes can hold each other's writes while a
  primary is down), the node runs the replayer every ``replay_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hmac
import ipaddress
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from logstore.errors import ConfigurationError, InvalidArgumentError, LogstoreError
from logstore.node import openapi, wire
from logstore.store import Store

logger = logging.getLogger(__name__)
T = TypeVar("T")
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_QUERY = {"/v1/shards/{shard}/log": frozenset({"after", "limit", "columns"}),
          "/v1/shards/{shard}/count": frozenset({"after", "columns"}),
          "/v1/shards/{shard}/location": frozenset({"at"})}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ServerConfig(BaseModel):
    """How a worker node listens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535, description="0 picks a free port")
    token: SecretStr | None = Field(None, description="required as a Bearer token on every request when set")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies get 413")
    threads: int = Field(8, ge=1, le=512, description="blocking store calls at once (the MySQL pool holds 8)")
    replay_interval: float = Field(1.0, gt=0, description="seconds between passes of the buffered-write replayer")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        self.metrics = _Metrics(registry or CollectorRegistry())
        self._pool: ThreadPoolExecutor | None = None
        self._runner: web.AppRunner | None = None
        self._port = self.config.port
        self._replayer: asyncio.Task[None] | None = None
        self._first_shard = {store.node_of(s): s for s in reversed(range(store.shard_count))}
        self._openapi = wire.dumps(openapi.document())

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self._port}"

    # -- lifecycle ------------------------------------------------------------------
    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors, self._auth, self._query])
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.prometheus)
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/v1/info", self.info)
        r.add_post("/v1/cells", self.put_cells)
        r.add_post("/v1/system/cells", self.put_system_cells)
        r.add_get("/v1/rows/{row_key}", self.get_row)
        r.add_get("/v1/rows/{row_key}/{column}", self.get_latest)
        r.add_get("/v1/rows/{row_key}/{column}/{ref_key}", self.get_cell)
        r.add_put("/v1/rows/{row_key}/{column}/{ref_key}", self.put_cell)
        r.add_get("/v1/shards", self.shards)
        r.add_get("/v1/shards/{shard}", self.shard)
        r.add_get("/v1/shards/{shard}/log", self.log)
        r.add_get("/v1/shards/{shard}/count", self.count)
        r.add_get("/v1/shards/{shard}/location", self.location)
        r.add_post("/v1/logs", self.logs)
        r.add_get("/v1/offsets/{consumer}", self.read_offsets)
        r.add_post("/v1/offsets/{consumer}/claim", self.claim_offsets)
        r.add_post("/v1/offsets/{consumer}/commit", self.commit_offsets)
        return app

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="worker-node")
        runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            self._pool.shutdown(wait=False)
            self._pool = None
            where = f"{self.config.host}:{self.config.port}"
            raise ConfigurationError(f"cannot listen on {where}: {exc.strerror}") from None
        self._runner = runner
        await self._warm()
        if self.store.buffers_writes:
            self._replayer = asyncio.create_task(self._replay(), name="worker-node-replayer")
        server = site._server  # the bound socket tells the port when 0 was asked for
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self._port = sockets[0].getsockname()[1]
        logger.info("worker node on %s (%s)", self.url,
                    "token required" if self.config.token else "no token: loopback only, unauthenticated")

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

        for shard in self._first_shard.values():
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
        replayer, self._replayer = self._replayer, None
        if replayer is not None:
            replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replayer
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
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
        try:
            response = await handler(request)
        except LogstoreError as exc:
            response = _json(wire.error_json(exc), wire.error_status(exc))
            if exc.retriable:
                response.headers["Retry-After"] = "1"
        except _BadInput as exc:
            response = _json(wire.bad_request(exc.field, exc.problem), 400)
        except web.HTTPException as exc:
            response = _json({"error": {"type": "HTTPError", "message": exc.reason, "retriable": False}},
                             exc.status)
            for name in ("WWW-Authenticate", "Allow"):
                if name in exc.headers:
                    response.headers[name] = exc.headers[name]
        except Exception:
            logger.exception("worker node: %s %s failed", request.method, request.path)
            response = _json({"error": {"type": "InternalError", "retriable": False,
                                        "message": "the worker node failed unexpectedly; its log says why"}}, 500)
        self.metrics.requests.labels(route, request.method, str(response.status)).inc()
        self.metrics.seconds.labels(route).observe(time.perf_counter() - started)
        return response

    @web.middleware
    async def _query(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """An API route refuses query parameters it does not know: a misspelt ``limit`` is an error, not ignored."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else ""
        if route.startswith("/v1/"):
            allowed = _QUERY.get(route, frozenset())
            unknown = sorted(set(request.query) - allowed)
            if unknown:
                raise _BadInput(unknown[0], f"unknown query parameter (this route takes: "
                                            f"{', '.join(sorted(allowed)) or 'none'})")
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        token = self.config.token
        if token is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(),
                                                                      token.get_secret_value().encode()):
                raise web.HTTPUnauthorized(reason="a valid Authorization: Bearer token is required",
                                           headers={"WWW-Authenticate": 'Bearer realm="cellstream"'})
        return await handler(request)

    # -- service --------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        nodes: dict[str, str] = {}
        for node, shard in self._first_shard.items():
            try:
                await self._call(self.store.head, shard)
                nodes[node] = "ok"
            except LogstoreError as exc:
                nodes[node] = str(exc)
        ready = all(v == "ok" for v in nodes.values())
        return _json({"ready": ready, "nodes": nodes}, 200 if ready else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def info(self, request: web.Request) -> web.Response:
        return _json({"shards": self.store.shard_count, "nodes": self.store.nodes,
                      "max_body_bytes": self.config.max_body_bytes})

    # -- cells ----------------------------------------------------------------------
    async def put_cells(self, request: web.Request, system: bool = False) -> web.Response:
        put = _model(wire.PutCells, await _body(request))
        cells = [(c.row_key, c.column, c.ref_key, c.body) for c in put.cells]
        stored = await self._call(self.store.put_system_cells if system else self.store.put_cells, cells)
        self.metrics.cells.inc(len(stored))
        return _json({"cells": [c.to_json() for c in stored]})

    async def put_system_cells(self, request: web.Request) -> web.Response:
        return await self.put_cells(request, system=True)

    async def put_cell(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if not isinstance(body, dict):
            raise _BadInput("body", f"expected a JSON object, got {type(body).__name__}")
        m = request.match_info
        cell = await self._call(self.store.put_cell, m["row_key"], m["column"], _int(m["ref_key"], "ref_key"), body)
        self.metrics.cells.inc()
        return _json(cell.to_json())

    async def get_cell(self, request: web.Request) -> web.Response:
        m = request.match_info
        cell = await self._call(self.store.get_cell, m["row_key"], m["column"], _int(m["ref_key"], "ref_key"))
        if cell is None:
            return _not_found("no cell at these coordinates")
        return _json(cell.to_json())

    async def get_latest(self, request: web.Request) -> web.Response:
        m = request.match_info
        cell = await self._call(self.store.get_cell_latest, m["row_key"], m["column"])
        if cell is None:
            return _not_found("no cell in this row and column")
        return _json(cell.to_json())

    async def get_row(self, request: web.Request) -> web.Response:
        row = await self._call(self.store.get_row, request.match_info["row_key"])
        return _json({"cells": {column: cell.to_json() for column, cell in row.items()}})

    # -- shards and logs --------------------------------------------------------------
    def _shard(self, text: str, field: str) -> int:
        shard = _int(text, field)
        if shard >= self.store.shard_count:
            raise _BadInput(field, f"{shard} is out of range: the shards are 0 to {self.store.shard_count - 1}")
        return shard

    async def shards(self, request: web.Request) -> web.Response:
        stats = await self._call(self.store.shard_stats)
        return _json({"shards": [{"shard": s.shard, "node": s.node, "cells": s.cells} for s in stats]})

    async def shard(self, request: web.Request) -> web.Response:
        shard = self._shard(request.match_info["shard"], "shard")
        head = await self._call(self.store.head, shard)
        return _json({"shard": shard, "node": self.store.node_of(shard), "head": head})

    async def log(self, request: web.Request) -> web.Response:
        shard = self._shard(request.match_info["shard"], "shard")
        after, limit = _query_int(request, "after", 0), _query_int(request, "limit", 1000)
        if limit < 1:
            raise _BadInput("limit", "must be at least 1")
        cells, next_location = await self._call(self.store.get_cells_for_shard, shard, after, limit,
                                                columns=_columns(request))
        return _json({"cells": [c.to_json() for c in cells], "next": next_location})

    async def count(self, request: web.Request) -> web.Response:
        shard = self._shard(request.match_info["shard"], "shard")
        count = await self._call(self.store.count_after, shard, _query_int(request, "after", 0),
                                 columns=_columns(request))
        return _json({"count": count})

    async def location(self, request: web.Request) -> web.Response:
        shard = self._shard(request.match_info["shard"], "shard")
        text = request.query.get("at")
        if text is None:
            raise _BadInput("at", "required: an ISO 8601 time with a UTC offset")
        try:
            when = dt.datetime.fromisoformat(text)
        except ValueError:
            raise _BadInput("at", f"{text!r} is not an ISO 8601 time") from None
        if when.utcoffset() is None:
            raise _BadInput("at", f"{text!r} has no UTC offset (e.g. 2026-11-24T10:00:00Z)")
        return _json({"location": await self._call(self.store.location_at, shard, when)})

    async def logs(self, request: web.Request) -> web.Response:
        query = _model(wire.LogsQuery, await _body(request))
        locations = {self._shard(k, f"locations.{k}"): v for k, v in query.locations.items()}
        for k, v in query.locations.items():
            if v < 0:
                raise _BadInput(f"locations.{k}", f"{v} is not a location (an added_id, 0 or more)")
        pages = await self._call(self.store.get_cells_for_shards, locations, query.limit, columns=query.columns)
        out: dict[str, Any] = {}
        for shard, page in pages.items():
            out[str(shard)] = (wire.error_json(page) if isinstance(page, LogstoreError)
                               else {"cells": [c.to_json() for c in page]})
        return _json({"pages": out})

    # -- offsets --------------------------------------------------------------------
    async def read_offsets(self, request: web.Request) -> web.Response:
        records = await self._call(self.store.read_offsets, _consumer(request))
        return _json({"offsets": {str(s): r._asdict() for s, r in records.items()}})

    async def claim_offsets(self, request: web.Request) -> web.Response:
        claim = _model(wire.ClaimOffsets, await _body(request))
        records = await self._call(self.store.claim_offsets, _consumer(request), claim.owner,
                                   claim.shards)
        return _json({"offsets": {str(s): r._asdict() for s, r in records.items()}})

    async def commit_offsets(self, request: web.Request) -> web.Response:
        commit = _model(wire.CommitOffsets, await _body(request))
        offsets = {_int(k, f"offsets.{k}"): (v.location, v.doc) for k, v in commit.offsets.items()}
        fenced = await self._call(self.store.commit_offsets, _consumer(request), commit.owner, offsets)
        return _json({"fenced": sorted(fenced)})


# -- input ----------------------------------------------------------------------------------
class _BadInput(Exception):
    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


async def _body(request: web.Request) -> Any:
    raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge (413)
    if not raw:
        raise _BadInput("body", "a JSON document is required")
    try:
        return wire.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _BadInput("body", f"not JSON: {exc}") from None


def _model(model: type[wire.BaseModelT], doc: Any) -> wire.BaseModelT:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise _BadInput(field, first["msg"]) from None


# ASCII only: int() would also take "+7", "1_000", " 3" and the digits of other scripts.
_DIGITS = re.compile(r"0|[1-9][0-9]{0,18}")


def _int(text: str, field: str) -> int:
    """A path or query integer: ASCII digits, no sign, no leading zero, below 2**63."""
    if not _DIGITS.fullmatch(text) or int(text) >= 1 << 63:
        raise _BadInput(field, f"{text!r} is not an integer from 0 to 2**63-1 in ASCII digits")
    return int(text)


def _query_int(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    return default if text is None else _int(text, name)


def _columns(request: web.Request) -> list[str] | None:
    text = request.query.get("columns")
    if text is None:
        return None
    names = text.split(",")
    if not all(names):
        raise _BadInput("columns", f"{text!r}: expected column names separated by single commas")
    return names


def _consumer(request: web.Request) -> str:
    name = request.match_info["consumer"]
    if not re.fullmatch(wire.CONSUMER_PATTERN, name):
        raise _BadInput("consumer", f"{name!r} does not match {wire.CONSUMER_PATTERN}")
    return name


def _not_found(message: str) -> web.Response:
    return _json({"error": {"type": "NotFound", "message": message, "retriable": False}}, 404)


def check_bind(host: str, token: str | None) -> None:
    """The refusal ``cellstream serve`` prints before it opens anything."""
    if token is None and not is_loopback(host):
        raise InvalidArgumentError(f"--bind {host}: without a token the worker node listens only on loopback "
                                   "(set CELLSTREAM_TOKEN or --token-file)")
