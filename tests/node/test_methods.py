"""The worker node answers every method right (issue 54, point 6), on raw sockets so nothing between the test
and the node fixes a request up: HEAD wherever GET (same status and headers, no body, same auth), 405 with
the route's exact `Allow` for a method a route lacks, 501 for a method no one knows, and the framing a route
cannot serve refused from the head alone (a body on GET, a declared body over the limit, an unknown
expectation, a repeated query parameter), with `100 Continue` sent only once the request passed every check."""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from aiohttp import web

import logstore
from logstore.node.routes import ROUTES, methods_of
from logstore.node.server import router_path
from tests.harness.worker_support import NodeThread, worker_node
from tests.node.test_hostile_clients import counted

SHARDS = 8
TOKEN = "methods-token-0123456789"
ROW = uuid.UUID("00000000-0000-4000-8000-000000000001")
SAMPLE = {"row_key": str(ROW), "column": "BASE", "ref_key": "1", "shard": "1", "consumer": "app", "name": "ix"}
QUERIES = {"/v1/shards/{shard}/location": "at=2026-01-01T00:00:00Z"}  # a required query parameter
VARYING = {"/metrics"}  # answers that change between two calls (the counters count the first)
OTHER_METHODS = ["OPTIONS", "TRACE", "DELETE", "PATCH", "PUT", "POST", "GET", "QUERY", "PROPFIND", "CONNECT"]


def concrete(path: str) -> str:
    query = QUERIES.get(path)
    return path.format(**SAMPLE) + (f"?{query}" if query else "")


def exchange(url: str, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send ``raw``; everything the node sends until it closes."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=timeout) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def request(url: str, method: str, target: str, headers: str = "", body: bytes = b"") -> tuple[int, dict[str, str],
                                                                                            bytes]:
    raw = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{headers}\r\n".encode() + body
    return parse(exchange(url, raw))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeThread]:
    url = f"sqlite:///{tmp_path_factory.mktemp('methods')}"
    with worker_node(url, SHARDS, body_timeout=2.0, max_body_bytes=64 << 10) as running:
        with logstore.open(running.url) as store:
            store.put_cell(ROW, "BASE", 1, {"n": 1})
        yield running


GET_ROUTES = sorted({r.path for r in ROUTES if r.method == "GET"})


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_answers_what_get_answers_without_the_body(node: NodeThread, path: str) -> None:
    got_status, got_headers, got_body = request(node.url, "GET", concrete(path))
    status, headers, body = request(node.url, "HEAD", concrete(path))
    assert status == got_status and body == b""
    assert headers["content-type"] == got_headers["content-type"]
    if path in VARYING:
        assert int(headers["content-length"]) > 0
    else:
        assert int(headers["content-length"]) == len(got_body) == int(got_headers["content-length"])


def test_head_takes_the_same_auth_as_get(sqlite_url: str) -> None:
    with worker_node(sqlite_url, SHARDS, token=TOKEN) as node:
        for method in ("GET", "HEAD"):
            status, headers, _ = request(node.url, method, "/v1/info")
            assert status == 401 and headers["www-authenticate"].startswith("Bearer"), (method, status)
            assert request(node.url, method, "/healthz")[0] == 200  # open to probes, HEAD too
            assert request(node.url, method, "/v1/info", f"Authorization: Bearer {TOKEN}\r\n")[0] == 200
        status, headers, _ = request(node.url, "POST", "/healthz", "Content-Length: 0\r\n")
        assert status == 405 and headers["allow"] == "GET,HEAD"  # no token makes it work: not a 401
        assert request(node.url, "DELETE", "/v1/info")[0] == 401  # a token route's refusals need the token first


PATHS = sorted({r.path for r in ROUTES})


@pytest.mark.parametrize("path", PATHS)
def test_a_method_a_route_lacks_is_405_with_its_exact_allow(node: NodeThread, path: str) -> None:
    allowed = {m for r in ROUTES if r.path == path for m in methods_of(r)}
    for method in OTHER_METHODS:
        if method in allowed or (method == "CONNECT" and "?" in concrete(path)):
            continue  # a CONNECT target with a query is no authority (host:port): the parser's 400
        status, headers, body = request(node.url, method, concrete(path))
        assert status == 405, (method, path, status, body)
        assert set(headers["allow"].split(",")) == allowed, (method, path, headers["allow"])
        error = json.loads(body)["error"]
        assert error["type"] == "HTTPError" and error["message"] == (
            f"{method} is not a method of this route: {', '.join(sorted(allowed))}"), error


@pytest.mark.parametrize("method", ["BREW", "get", "Post", "HEAD_"])
def test_a_method_nobody_knows_is_501_not_400(node: NodeThread, method: str) -> None:
    before = counted(request(node.url, "GET", "/metrics")[2].decode(), "cellstream_worker_connection_errors_total",
                     status="501", reason="unknown_method")
    status, headers, body = request(node.url, method, "/v1/info")
    assert status == 501 and headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["type"] == "NotImplemented" and repr(method) in error["message"], error
    after = counted(request(node.url, "GET", "/metrics")[2].decode(), "cellstream_worker_connection_errors_total",
                    status="501", reason="unknown_method")
    assert after == before + 1


def test_a_repeated_query_parameter_is_refused_naming_it(node: NodeThread) -> None:
    status, _, body = request(node.url, "GET", "/v1/shards/1/log?after=0&limit=1&limit=500")
    assert status == 400
    assert json.loads(body)["error"]["field"] == "limit" and "more than once" in json.loads(body)["error"]["problem"]
    assert request(node.url, "GET", "/v1/shards/1/log?after=0&limit=1")[0] == 200


@pytest.mark.parametrize(("method", "framing"), [
    ("GET", "Content-Length: 5\r\n"), ("HEAD", "Content-Length: 5\r\n"), ("GET", "Transfer-Encoding: chunked\r\n"),
    ("POST", "Content-Length: 5\r\n"),  # POST /v1/pending/replay takes no body either
])
def test_a_body_on_a_route_that_takes_none_is_refused(node: NodeThread, method: str, framing: str) -> None:
    target = "/v1/pending/replay" if method == "POST" else "/v1/info"
    body = b"5\r\nhello\r\n0\r\n\r\n" if "chunked" in framing else b"hello"
    status, headers, answer = request(node.url, method, target, framing, body)
    assert status == 400 and headers["connection"] == "close"
    if method != "HEAD":  # not a cell's body: no InvalidCellError
        assert json.loads(answer)["error"]["field"] == "body"
        assert json.loads(answer)["error"]["type"] == "InvalidArgumentError"
    assert request(node.url, method, target, "Content-Length: 0\r\n")[0] == 200  # an empty body is none


def head_then(url: str, head: bytes, wait: float = 1.0) -> tuple[socket.socket, bytes]:
    """Send a request's head only; what the node says within ``wait`` s (the socket stays open)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10)
    sock.sendall(head)
    sock.settimeout(wait)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and not data.startswith(b"HTTP/1.1 100"):
                break
            if data == b"HTTP/1.1 100 Continue\r\n\r\n":
                break
    except TimeoutError:
        pass
    sock.settimeout(10)
    return sock, data


def cells_head(length: int, extra: str = "") -> bytes:
    return (f"POST /v1/cells HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def test_100_continue_only_for_a_request_that_passed_every_check(sqlite_url: str) -> None:
    row = uuid.uuid4()
    body = json.dumps({"cells": [{"row_key": str(row), "column": "BASE", "ref_key": 1, "body": {"ok": 1}}]}).encode()
    with worker_node(sqlite_url, SHARDS, token=TOKEN, max_body_bytes=64 << 10) as node:
        auth = f"Authorization: Bearer {TOKEN}\r\n"
        refusals = [(cells_head(len(body), "Expect: 100-continue\r\n"), 401),  # no token: no go-ahead
                    (cells_head(10 << 20, auth + "Expect: 100-continue\r\n"), 413),  # over the limit declared
                    (cells_head(10 << 20, auth), 413),  # the same without Expect: refused before it is sent
                    (cells_head(len(body), auth + "Expect: 100-continue\r\n").replace(
                        b"application/json", b"text/plain"), 415),
                    (cells_head(len(body), auth + "Expect: teapot\r\n"), 417)]
        for head, expected in refusals:
            sock, data = head_then(node.url, head)
            with sock:
                assert not data.startswith(b"HTTP/1.1 100"), (expected, data[:200])
                status, _, answer = parse(data)
                assert status == expected, (expected, data[:300])
                assert json.loads(answer)["error"]["message"]
        sock, data = head_then(node.url, cells_head(len(body), auth + "Expect: 100-continue\r\n"))
        with sock:
            assert data == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(body)
            rest = b""
            while chunk := sock.recv(65536):
                rest += chunk
        assert parse(rest)[0] == 200
        with logstore.open(node.url, token=TOKEN) as store:
            assert store.get_cell(row, "BASE", 1) is not None


def test_a_body_the_client_cuts_off_or_garbles_is_its_error_not_a_traceback(
        node: NodeThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sock, _ = head_then(node.url, cells_head(1000), wait=0.1)
    sock.sendall(b'{"cells": [')
    time.sleep(0.2)
    sock.close()  # gone mid-body
    garbled = b"not gzip at all"
    status, _, answer = request(node.url, "POST", "/v1/cells", "Content-Type: application/json\r\n"
                                f"Content-Encoding: gzip\r\nContent-Length: {len(garbled)}\r\n", garbled)
    assert status == 400 and json.loads(answer)["error"]["type"] == "BadRequestBody"
    time.sleep(0.3)  # the node has seen the first connection go
    assert request(node.url, "GET", "/healthz")[0] == 200
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("aiohttp", "logstore"))]
    assert not loud, [r.getMessage() for r in loud]


def test_only_http_1_is_served(node: NodeThread) -> None:
    status, _, body = parse(exchange(node.url, b"GET /v1/info\r\n\r\n"))  # HTTP/0.9's request line
    assert status == 505 and json.loads(body)["error"]["type"] == "HTTPVersionNotSupported"
    assert parse(exchange(node.url, b"GET /v1/info HTTP/1.0\r\n\r\n"))[0] == 200


def test_percent_encoded_path_parameters_are_decoded_once_and_validated(node: NodeThread) -> None:
    plain = request(node.url, "GET", f"/v1/rows/{ROW}/BASE/1")
    encoded = request(node.url, "GET", f"/v1/rows/{str(ROW)[:-1]}%3{str(ROW)[-1]}/%42ASE/%31")
    assert plain[0] == encoded[0] == 200 and json.loads(plain[2]) == json.loads(encoded[2])
    # An encoded slash stays inside its parameter: never another route, a 400 naming the parameter.
    status, _, body = request(node.url, "GET", f"/v1/rows/{ROW}%2FBASE")
    assert status == 400 and json.loads(body)["error"]["field"] == "row_key"
    status, _, body = request(node.url, "GET", "/v1/offsets/app%2F..%2F..%2Finfo")
    assert status == 400 and json.loads(body)["error"]["field"] == "consumer"
    status, _, body = request(node.url, "GET", "/v1/offsets/%ff%fe")  # not UTF-8 once decoded
    assert status == 400 and json.loads(body)["error"]["field"] == "consumer"


def test_a_parameter_does_not_match_a_sibling_routes_literal() -> None:
    paths = ["/v1/rows/{row_key}/{column}/{ref_key}", "/v1/rows/{row_key}/{column}/versions", "/v1/rows/{row_key}"]
    pattern = router_path(paths[0], paths)
    assert pattern == "/v1/rows/{row_key}/{column}/{ref_key:(?!(?:versions)(?:/|$))[^{}/]+}"
    assert router_path(paths[1], paths) == paths[1] and router_path(paths[2], paths) == paths[2]
    compiled = web.DynamicResource(pattern)
    assert compiled.canonical == paths[0]  # what the auth middleware looks routes up by
    assert compiled._match("/v1/rows/r/BASE/versions") is None and compiled._match("/v1/rows/r/BASE/7") is not None

