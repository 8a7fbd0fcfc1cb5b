"""The client of a worker node: a recorder holding every shard, over the worker node's HTTP API.

The store validates and routes as it does locally (bad input never leaves the process), and the worker
node's answers come back as the same cells and :class:`~logstore.errors.LogstoreError` s, so an app switches
between a local store and a worker node by URL. Index queries go to the node (``query_index``); the index
tables themselves (``indexes``: create, apply, backfill) are the node's, and raise ConfigurationError.
Connections are kept alive, one per thread (stdlib ``http.client``); a request on a kept-alive connection the
server closed meanwhile is sent once more on a new one (every request is safe to repeat). A node that cannot
be reached, or answers 503, is a retriable StorageUnavailableError.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import logging
import os
import ssl
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import msgpack

from logstore.backends.http.target import HttpTarget
from logstore.cell import AnyCell, Cell
from logstore.config import StoreOptions
from logstore.errors import (
    AuthenticationError,
    ConfigurationError,
    CorruptCellError,
    IndexUnknownError,
    StorageUnavailableError,
)
from logstore.index_tables.persistence import IndexEntry, IndexRecorder, IndexSpec, Order
from logstore.index_tables.query import IndexInfo, entry_from_json, json_condition
from logstore.node.models import MAX_READ_BATCH
from logstore.node.wire import cell_from_json, dumps, error_from_json, loads
from logstore.offsets import OffsetRecord
from logstore.persistence import (
    CellRead,
    ChangedCounts,
    NodeMeta,
    NodeRecorder,
    PendingCell,
    PendingCounts,
    PendingReport,
    ReadBudget,
    TruncatedPage,
    check_meta,
    repack,
)
from logstore.retry import RetryPolicy

logger = logging.getLogger(__name__)
_UNBOUNDED = 1 << 62  # a budget this large is a read without max_bytes (Store.read_cells)


class HttpRecorder(NodeRecorder):
    """The worker node at ``target`` holding every shard (see the module docstring). ``token`` is the Bearer
    token of its requests; None: the CELLSTREAM_TOKEN environment variable's, if set."""

    parallel_writes = 1  # the node's own store may be SQLite, with its one writer

    def __init__(self, name: str, target: HttpTarget, options: StoreOptions, token: str | None = None) -> None:
        # Where the token came from, for a refusal's message (never the token itself).
        self._token_source = "the token argument" if token is not None else None
        if token is None:
            token = os.environ.get("CELLSTREAM_TOKEN") or None
            self._token_source = "the CELLSTREAM_TOKEN environment variable" if token else None
        self.name = name
        self.target = target
        parts = urlsplit(target.url)
        self._https = parts.scheme == "https"
        self._tls = target.ssl_context()
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._timeout = options.read_timeout
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._meta: NodeMeta | None = None
        self._counts_route = True  # False once the node said it has no /v1/counts (an older version)
        self._local = threading.local()
        self._index_specs: dict[tuple[str, int], IndexSpec] = {}
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    @property
    def indexes(self) -> IndexRecorder:  # type: ignore[override]  # an attribute of the other recorders
        raise ConfigurationError(f"the index tables behind worker node {self.target.url} are the node's: query an "
                                 "index with Store.query_index (Index.query), or open the cluster file to keep one")

    answers_index_queries = True

    def query_index(self, name: str, where: Mapping[str, Any], *, order: Order, limit: int, scatter: bool,
                    version: int | None) -> list[IndexEntry]:
        """One ``POST /v1/indexes/{name}/query``, its entries typed by the version's fields (``GET /v1/indexes``,
        read once per version: a version's fields never change). An answer the node cut to its
        ``max_read_bytes`` comes back a TruncatedPage."""
        body: dict[str, Any] = {"where": {key: json_condition(value) for key, value in where.items()},
                                "order": order, "limit": limit, "scatter": scatter}
        if version is not None:
            body["version"] = version
        answer = self._request("POST", f"/v1/indexes/{_segment(name)}/query", body)
        spec = self._index_spec(name, int(answer["version"]))
        entries = [entry_from_json(spec, doc) for doc in answer["entries"]]
        return TruncatedPage(entries) if answer.get("truncated") is True and entries else entries

    def index_info(self, name: str) -> IndexInfo:
        """Index ``name`` from ``GET /v1/indexes``."""
        listed = {info.name: info for info in self._list_indexes()}
        if name not in listed:
            raise IndexUnknownError(f"no index named {name!r} on worker node {self.target.url} (an app registers "
                                    "it with app.index(...))")
        return listed[name]

    def _list_indexes(self) -> list[IndexInfo]:
        infos = [IndexInfo.from_json(doc) for doc in self._request("GET", "/v1/indexes")["indexes"]]
        for info in infos:
            for found in info.versions:
                self._index_specs[(info.name, found.version)] = found.spec
        return infos

    def _index_spec(self, name: str, version: int) -> IndexSpec:
        spec = self._index_specs.get((name, version))
        if spec is None:
            self._list_indexes()
            spec = self._index_specs.get((name, version))
            if spec is None:  # dropped between the query and the listing
                raise IndexUnknownError(f"index {name} version {version} is no longer listed by worker node "
                                        f"{self.target.url}; query again")
        return spec

    # -- transport ------------------------------------------------------------------
    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = (http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout, context=self._tls)
                if self._https else http.client.HTTPConnection(self._host, self._port, timeout=self._timeout))
        self._local.conn = conn
        with self._lock:
            self._all.append(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def _request(self, method: str, path: str, body: Any = None, *, missing_ok: bool = False,
                 unknown_route_ok: bool = False) -> Any:
        payload = dumps(body) if body is not None else None
        while True:
            conn, reused = self._connection()
            try:
                conn.request(method, self._prefix + path, payload, self._headers)
                response = conn.getresponse()
                raw = response.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                # A kept-alive connection the server closed while idle fails on first use: once more, anew.
                if reused and isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError,
                                               BrokenPipeError, http.client.BadStatusLine)):
                    continue
                if isinstance(exc, ssl.SSLCertVerificationError):  # retrying cannot help: a setting is wrong
                    raise ConfigurationError(f"worker node {self.target.url}: its TLS certificate is not trusted "
                                             f"({exc.verify_message}; give its CA as ?ssl_ca=FILE)") from None
                raise StorageUnavailableError(f"worker node {self.target.url}: {method} {path}: "
                                              f"{type(exc).__name__}: {exc}") from None
        if response.getheader("Connection", "").lower() == "close":
            self._drop(conn)
        try:
            doc = loads(raw) if raw else None
        except ValueError:
            doc = None
        if 200 <= response.status < 300:
            return doc
        if missing_ok and response.status == 404 and isinstance(doc, dict) and \
                doc.get("error", {}).get("type") == "NotFound":
            return None
        if unknown_route_ok and response.status == 404 and isinstance(doc, dict) and \
                doc.get("error", {}).get("type") == "HTTPError":  # aiohttp's: no such route
            return None
        error = error_from_json(response.status, doc)
        if isinstance(error, AuthenticationError):
            told = (f"the token sent came from {self._token_source}" if self._token_source else
                    "no token was sent: set the CELLSTREAM_TOKEN environment variable, or give logstore.open one")
            raise AuthenticationError(f"{error} ({told})")
        raise error

    # -- instance -------------------------------------------------------------------
    def read_meta(self, retry: RetryPolicy | None = None) -> NodeMeta | None:
        info = self._request("GET", "/v1/info")
        self._meta = NodeMeta(int(info["shards"]), 0, int(info["shards"]) - 1)
        return self._meta

    def initialize(self, meta: NodeMeta, retry: RetryPolicy | None = None) -> None:
        # logstore.open read the node's metadata just before: checked against it, not fetched again.
        check_meta(self.name, self._meta or self.read_meta() or meta, meta)

    # -- cells ----------------------------------------------------------------------
    def insert(self, cells: Sequence[PendingCell], retry: RetryPolicy | None = None) -> list[Cell]:
        system = any(c.column.startswith("_") for c in cells)
        docs = [{"row_key": str(c.row_key), "column": c.column, "ref_key": c.ref_key, "body": c.body} for c in cells]
        answer = self._request("POST", "/v1/system/cells" if system else "/v1/cells", {"cells": docs})
        return [cell_from_json(doc) for doc in answer["cells"]]

    def get_cell(self, shard: int, row_key: uuid.UUID, column: str, ref_key: int) -> Cell | None:
        doc = self._request("GET", f"/v1/rows/{row_key}/{column}/{ref_key}", missing_ok=True)
        return cell_from_json(doc) if doc is not None else None

    def get_latest(self, shard: int, row_key: uuid.UUID, column: str, as_of: dt.datetime | None = None) -> Cell | None:
        doc = self._request("GET", f"/v1/rows/{row_key}/{column}{_as_of(as_of)}", missing_ok=True)
        return cell_from_json(doc) if doc is not None else None

    def get_row(self, shard: int, row_key: uuid.UUID, as_of: dt.datetime | None = None) -> list[Cell]:
        return [cell_from_json(doc)
                for doc in self._request("GET", f"/v1/rows/{row_key}{_as_of(as_of)}")["cells"].values()]

    def get_versions(self, shard: int, row_key: uuid.UUID, column: str, before: int | None, limit: int,
                     budget: ReadBudget) -> list[Cell]:
        """A page of ``GET /v1/versions/{row_key}/{column}``. The node holds it to its store's
        ``max_read_bytes`` (``budget`` is this process's, which the node does not take): a page it cut short
        comes back a TruncatedPage."""
        query = {"limit": limit, **({"before": before} if before is not None else {})}
        answer = self._request("GET", f"/v1/versions/{row_key}/{column}?{urlencode(query)}")
        cells = [cell_from_json(doc) for doc in answer["cells"]]
        return TruncatedPage(cells) if answer.get("truncated") is True and cells else cells

    def read_cells(self, coordinates: Sequence[CellRead], as_of: dt.datetime | None,
                   budget: ReadBudget) -> list[Cell | None]:
        """One ``POST /v1/cells/read`` of the first MAX_READ_BATCH coordinates. The node holds its answer to its
        store's ``max_read_bytes`` and to a ``budget`` that is bounded (``max_bytes``): an answer shorter than
        ``coordinates`` is a TruncatedPage, and the store asks again for the rest while its budget lasts."""
        part = coordinates[:MAX_READ_BATCH]
        body: dict[str, Any] = {"cells": [{"row_key": str(key), "column": column, "ref_key": ref}
                                          for _, key, column, ref in part]}
        if as_of is not None:
            body["as_of"] = as_of.isoformat()
        bounded = budget.room < _UNBOUNDED
        if bounded:
            body["max_bytes"] = max(budget.room, 1)
        answer = self._request("POST", "/v1/cells/read", body)
        cells = [cell_from_json(doc) if doc is not None else None for doc in answer["cells"]]
        if bounded:  # spent as the node counted it: the bodies' MessagePack bytes
            budget.room -= sum(len(msgpack.packb(c.body)) for c in cells if c is not None)
            if answer.get("truncated") is True:
                budget.room = min(budget.room, 0)
        return TruncatedPage(cells) if len(cells) < len(coordinates) else cells

    # -- logs -----------------------------------------------------------------------
    def read_logs(self, locations: Sequence[tuple[int, int]], limit: int, columns: Sequence[str] | None,
                  packed: bool, budget: ReadBudget) -> Callable[[], Mapping[int, Sequence[AnyCell] | CorruptCellError]]:
        """One request for every shard's page (``POST /v1/logs``), decoded as it arrives; packed pages are the
        decoded bodies packed again (the node sends JSON). The node's store holds its answer to its own
        ``max_read_bytes`` (``budget`` is this process's, which the node does not take): a page it cut short
        says ``"truncated": true`` and comes back a TruncatedPage, so that a reader reads on after it."""
        answer = self._request("POST", "/v1/logs", {"locations": {str(s): at for s, at in locations}, "limit": limit,
                                                    "columns": list(columns) if columns else None})
        out: dict[int, Sequence[AnyCell] | CorruptCellError] = {}
        for shard, page in answer["pages"].items():
            if "error" in page:
                error = error_from_json(500, page)
                if not isinstance(error, CorruptCellError):
                    raise error
                if packed:
                    error.cells_before = [repack(c) for c in error.cells_before]
                out[int(shard)] = error
            else:
                cells = [cell_from_json(doc) for doc in page["cells"]]
                got: Sequence[AnyCell] = [repack(c) for c in cells] if packed else cells
                out[int(shard)] = TruncatedPage(got) if page.get("truncated") is True and got else got
        return lambda: out

    def first_at(self, shard: int, when: dt.datetime) -> int | None:
        # The node answers Store.location_at whole (first - 1, or its head), which the calling
        # Store.location_at gives back unchanged from this: it subtracts the 1 again.
        found = self._request("GET", f"/v1/shards/{shard}/location?{urlencode({'at': when.isoformat()})}")
        return int(found["location"]) + 1

    def head(self, shard: int) -> int:
        return int(self._request("GET", f"/v1/shards/{shard}")["head"])

    def count_after(self, shard: int, location: int, columns: Sequence[str] | None = None,
                    reserved: bool = True) -> int:
        query = {"after": location, **({"columns": ",".join(columns)} if columns else {}),
                 **({} if reserved else {"reserved": "false"})}
        return int(self._request("GET", f"/v1/shards/{shard}/count?{urlencode(query)}")["count"])

    def shard_counts(self) -> dict[int, int]:
        return self.changed_counts(None).counts

    def changed_counts(self, since: object | None) -> ChangedCounts:
        """The node's own partial counts (``GET /v1/counts``); its marks are tokens it takes back. A node of
        an older version, without the route, answers every shard's count each time."""
        if self._counts_route:
            answer = self._request("GET", "/v1/counts" + (f"?{urlencode({'since': since})}"
                                                          if isinstance(since, str) else ""), unknown_route_ok=True)
            if answer is not None:
                return ChangedCounts(dict(zip(answer["shards"], answer["cells"], strict=True)), answer["mark"],
                                     bool(answer["complete"]))
            logger.warning("worker node %s has no /v1/counts (an older version): every count poll counts every shard",
                           self.target.url)
            self._counts_route = False
        counts = {int(s["shard"]): int(s["cells"]) for s in self._request("GET", "/v1/shards")["shards"]}
        return ChangedCounts(counts, None, True)

    # -- buffered writes of the store behind the node ----------------------------------
    def held_pending(self, name: str) -> PendingCounts:
        """The node's store's buffered cells (``GET /v1/pending``): its storage nodes are the holders."""
        answer = self._request("GET", "/v1/pending", unknown_route_ok=True)
        if answer is None:
            raise ConfigurationError(f"worker node {self.target.url} does not list buffered writes (a version "
                                     "without GET /v1/pending): run `cellstream pending` with --store CLUSTER, the "
                                     "cluster file of the storage nodes behind it")
        held = {home: {holder: (int(c["waiting"]), int(c["failed"])) for holder, c in holders.items()}
                for home, holders in answer["held"].items()}
        return PendingCounts(held, [str(n) for n in answer["unreachable"]])

    def replay_behind(self) -> PendingReport:
        """One replay pass run by the node (``POST /v1/pending/replay``), as it runs one every second."""
        answer = self._request("POST", "/v1/pending/replay", unknown_route_ok=True)
        if answer is None:
            raise ConfigurationError(f"worker node {self.target.url} cannot be asked to replay buffered writes (a "
                                     "version without POST /v1/pending/replay): it replays them every second itself")
        return PendingReport(int(answer["replayed"]), int(answer["failed"]), int(answer["waiting"]),
                             [str(n) for n in answer["unreachable"]])

    # -- offsets --------------------------------------------------------------------
    def claim_offsets(self, consumer: str, owner: str, shards: Sequence[int]) -> list[OffsetRecord]:
        answer = self._request("POST", f"/v1/offsets/{_segment(consumer)}/claim",
                               {"owner": owner, "shards": list(shards)})
        return _records(answer)

    def commit_offsets(self, consumer: str, owner: str, offsets: dict[int, tuple[int, str]]) -> set[int]:
        body = {"owner": owner, "offsets": {str(s): {"location": at, "doc": json.loads(doc)}
                                            for s, (at, doc) in offsets.items()}}
        return {int(s) for s in self._request("POST", f"/v1/offsets/{_segment(consumer)}/commit", body)["fenced"]}

    def read_offsets(self, consumer: str) -> list[OffsetRecord]:
        return _records(self._request("GET", f"/v1/offsets/{_segment(consumer)}"))

    supports_backup = False

    def consumers(self) -> list[str]:
        return [str(name) for name in self._request("GET", "/v1/offsets")["consumers"]]

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local = threading.local()


def _as_of(as_of: dt.datetime | None) -> str:
    """The query string of a read as of a time ("" for the latest)."""
    return "" if as_of is None else f"?{urlencode({'as_of': as_of.isoformat()})}"


def _segment(text: str) -> str:
    return quote(text, safe="")


def _records(answer: dict[str, Any]) -> list[OffsetRecord]:
    return [OffsetRecord(int(r["shard"]), r["location"], str(r["owner"]), dict(r["doc"]))
            for r in answer["offsets"].values()]
