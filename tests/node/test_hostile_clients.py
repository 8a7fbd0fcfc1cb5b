"""The worker node against clients that misbehave: requests its HTTP parser refuses, headers and bodies
trickled in, too many connections, tokens that may not write cellstream's own columns. Every answer is
the JSON error document, and a client's error never logs a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

import logstore
from logstore.node.connections import MAX_PER_CLIENT, SLOW_HEAD, Limits, client_of, protocol_factory, track_requests
from logstore.node.server import ServerConfig
from tests.harness.worker_support import NodeThread, worker_node

SHARDS = 8
TOKEN = "hostile-token-0123456789"
ADMIN = "hostile-admin-token"


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10)


def read_all(sock: socket.socket, limit: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (every answer here closes it)."""
    sock.settimeout(limit)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
    """One whole response: status, headers, the JSON body."""
    head, _, body = read_all(sock).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.fixture
def node(sqlite_url: str) -> Iterator[NodeThread]:
    with worker_node(sqlite_url, SHARDS, header_timeout=1.0, body_timeout=1.0) as running:
        yield running


UNPARSABLE = [
    pytest.param(b"G\x01T / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", id="method-with-a-control-character"),
    pytest.param(b"GET /v1/rows/\xff\xfe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", id="path-not-utf8"),
    pytest.param(b"POST /v1/cells HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n"
                 b"0\r\n\r\n", id="content-length-and-chunked"),
    pytest.param(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", id="oversize-url"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n", id="oversize-header"),
    pytest.param(b"NOT HTTP AT ALL\r\n\r\n", id="not-http"),
    pytest.param(b"GET /v1/info HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200))
                 + b"\r\n", id="too-many-headers"),  # 200 small ones: each under the line limit, together not
]


@pytest.mark.parametrize("raw", UNPARSABLE)
def test_what_the_parser_refuses_is_a_json_error_without_a_traceback(
        node: NodeThread, raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with connect(node.url) as sock:
        sock.sendall(raw)
        status, headers, doc = read_response(sock)
    assert 400 <= status < 500
    assert headers["content-type"].startswith("application/json")
    assert set(doc["error"]) >= {"type", "message", "retriable"} and doc["error"]["retriable"] is False
    loud = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith(("aiohttp", "logstore"))]
    assert not [r for r in loud if r.exc_info], [r.getMessage() for r in loud]
    assert not [r for r in caplog.records if r.exc_info and r.levelno > logging.DEBUG]


def test_clients_trickling_headers_are_answered_408_and_cut_off(node: NodeThread) -> None:
    # 20 connections each sending one more header byte every 0.2 s: none holds on past the 1 s head deadline.
    socks = [connect(node.url) for _ in range(20)]
    for sock in socks:
        sock.sendall(b"GET /v1/info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        sock.settimeout(0.01)
    started = time.monotonic()
    answers: dict[socket.socket, bytes] = {}
    try:
        while len(answers) < len(socks) and time.monotonic() - started < 15:
            for sock in socks:
                if sock in answers:
                    continue
                try:
                    sock.sendall(b"a")
                    answers[sock] = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    answers[sock] = b""
            time.sleep(0.2)
        assert len(answers) == len(socks), f"{len(socks) - len(answers)} connections still open after 15 s"
        statuses = {data.split(b" ")[1] if data else b"closed" for data in answers.values()}
        assert statuses == {b"408"}, statuses
        assert all(b'"type":"RequestTimeout"' in data for data in answers.values())
    finally:
        for sock in socks:
            sock.close()


def test_a_body_that_does_not_arrive_is_answered_408(node: NodeThread) -> None:
    with connect(node.url) as sock:
        sock.sendall(b"POST /v1/cells HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"cells\": [")
        status, _, doc = read_response(sock)
    assert status == 408 and doc["error"]["type"] == "RequestTimeout"
    assert "body" in doc["error"]["message"]


def test_a_connection_over_the_cap_is_answered_503_retriable(sqlite_url: str) -> None:
    with worker_node(sqlite_url, SHARDS, max_connections=4, header_timeout=30.0) as node:
        held = [connect(node.url) for _ in range(4)]
        try:
            time.sleep(0.2)  # the four are accepted before the fifth
            with connect(node.url) as extra:
                status, headers, doc = read_response(extra)
            assert status == 503 and headers["retry-after"] == "1"
            assert doc["error"]["retriable"] is True and "4 connections" in doc["error"]["message"]
        finally:
            for sock in held:
                sock.close()
        deadline, refused = time.monotonic() + 10, 1
        while True:  # once the node has seen them go, connections are served again
            try:
                with logstore.open(node.url) as store:
                    assert store.shard_count == SHARDS
                break
            except logstore.StorageUnavailableError:
                refused += 1
                assert time.monotonic() < deadline
                time.sleep(0.1)
        metrics = _get(node.url, "/metrics").decode()
        assert counted(metrics, "cellstream_worker_connection_errors_total", status="503") == refused


def counted(metrics: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with ``labels`` (and any others) in a /metrics page."""
    return sum(sample.value for family in text_string_to_metric_families(metrics) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def connect_from(source: str, url: str) -> socket.socket:
    """A connection from the loopback address ``source`` (127.0.0.2 is another client than 127.0.0.1)."""
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10, source_address=(source, 0))


def test_one_client_address_cannot_take_every_connection(sqlite_url: str) -> None:
    # One client opens as many connections as the node takes and trickles nothing: it gets its share (64, the
    # default per client) and 503 beyond it; another client address is still answered.
    with worker_node(sqlite_url, SHARDS, max_connections=80, header_timeout=30.0) as node:
        held = [connect_from("127.0.0.1", node.url) for _ in range(80)]
        try:
            for sock in held[:64]:
                sock.sendall(b"GET /v1/info HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head never finished
            refused = held[64:]  # sent nothing: a request written to a connection closed resets it
            for sock in refused:
                status, headers, doc = read_response(sock)
                assert status == 503 and headers["retry-after"] == "1" and doc["error"]["retriable"] is True
                assert "limit of 64 connections per client" in doc["error"]["message"], doc
            for _ in range(3):  # the other client, again and again
                with connect_from("127.0.0.2", node.url) as other:
                    other.sendall(b"GET /v1/info HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    status, _, doc = read_response(other)
                assert status == 200 and doc["shards"] == SHARDS, doc
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 10
        while b"per client" in (page := _get(node.url, "/metrics")):  # until the node has seen them go
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert counted(page.decode(), "cellstream_worker_connection_errors_total", status="503") >= len(refused)


def _get(url: str, path: str, token: str | None = None) -> bytes:
    with connect(url) as sock:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n".encode())
        return read_all(sock).partition(b"\r\n\r\n")[2]


def test_system_cells_need_the_admin_token(sqlite_url: str) -> None:
    row = uuid.uuid4()
    with worker_node(sqlite_url, SHARDS, token=TOKEN, admin_token=ADMIN) as node:
        with logstore.open(node.url, token=TOKEN) as user:
            with pytest.raises(logstore.ConfigurationError, match="admin token"):
                user.put_system_cells([(row, "_dlq", 1, {"forged": True})])
            user.put_cell(row, "BASE", 1, {"plain": True})  # the token writes plain columns
        with logstore.open(node.url, token=ADMIN) as admin:
            admin.put_system_cells([(row, "_dlq", 1, {"real": True})])
            admin.put_cell(row, "BASE", 2, {"admin": True})  # and the admin token everything else
            assert admin.get_cell(row, "_dlq", 1).body == {"real": True}  # type: ignore[union-attr]
    with (worker_node(sqlite_url, SHARDS, token=TOKEN) as node, logstore.open(node.url, token=TOKEN) as user,
          pytest.raises(logstore.ConfigurationError, match="no admin token")):
        user.put_system_cells([(row, "_dlq", 2, {"forged": True})])
    with logstore.open(sqlite_url) as store:
        assert store.get_cell(row, "_dlq", 2) is None


@pytest.mark.parametrize(("settings", "problem"), [
    ({"admin_token": ADMIN}, "needs a token"),
    ({"token": TOKEN, "admin_token": TOKEN}, "must differ"),
    ({"tls_cert": "/x.pem"}, "both a certificate and its key"),
])
def test_inconsistent_settings_are_refused(settings: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ServerConfig(**settings)  # type: ignore[arg-type]


def test_a_batch_names_the_cell_it_refuses(sqlite_url: str) -> None:
    cells = [{"row_key": str(uuid.uuid4()), "column": "BASE", "ref_key": 1, "body": {"n": n}} for n in range(6)]
    checks = [(3, "column", "_dlq", "cells.3.column"), (4, "body", {"x": [1, {"n": 2**70}]}, "cells.4.body.x[1].n"),
              (2, "body", {"big": "x" * (5 << 20)}, "cells.2.body")]  # the last one the store refuses: too big
    with worker_node(sqlite_url, SHARDS, max_body_bytes=16 << 20) as big:
        for index, key, value, field in checks:
            sent = [dict(c) for c in cells]
            sent[index][key] = value
            with connect(big.url) as sock:
                body = json.dumps({"cells": sent}).encode()
                sock.sendall(b"POST /v1/cells HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                status, _, doc = read_response(sock)
            assert status == 400 and doc["error"]["field"] == field, doc
            assert doc["error"]["type"] == "InvalidCellError"
        with logstore.open(big.url) as store:
            assert store.get_row(cells[0]["row_key"]) == {}  # nothing of a refused batch was written



def test_the_count_per_client_returns_to_zero_however_connections_end() -> None:
    # Connections served, cut off for a slow head, refused over either cap, reset by the client, and open when
    # the server stops: every one admitted is counted once and released once.
    async def hello(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="hello")

    async def scenario() -> None:
        app = web.Application(middlewares=[track_requests])
        app.router.add_route("*", "/", hello)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        assert runner.server is not None
        refusals: list[tuple[int, str]] = []
        limits = Limits(0.5, 5.0, max_connections=8, max_connections_per_client=3)
        factory = protocol_factory(runner.server, limits, lambda status, reason: refusals.append((status, reason)))
        server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def opened(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))

        async def settled(expected: dict[str, int]) -> None:
            deadline = time.monotonic() + 5
            while factory.clients.open != expected:
                assert time.monotonic() < deadline, (factory.clients.open, expected)
                await asyncio.sleep(0.01)

        for _ in range(5):
            ones = [await opened("127.0.0.1") for _ in range(5)]  # 3 admitted, 2 refused per client
            twos = [await opened("127.0.0.2") for _ in range(2)]
            await settled({"127.0.0.1": 3, "127.0.0.2": 2})
            for reader, _ in ones[3:]:
                assert (await reader.read()).startswith(b"HTTP/1.1 503")
            (reader, writer), slow, reset = ones[0], ones[1], ones[2]
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")  # served, kept alive
            assert (await reader.readuntil(b"hello")).startswith(b"HTTP/1.1 200")
            twos[0][1].write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # served, closed
            assert (await twos[0][0].read()).endswith(b"hello")
            reset[1].write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhalf")
            await asyncio.sleep(0.01)
            reset[1].transport.abort()  # a reset mid-body
            await settled({"127.0.0.1": 2, "127.0.0.2": 1})
            slow[1].write(b"GET / HTTP/1.1\r\n")  # it and twos[1] (silent) are cut off at the head deadline
            for reader, _ in (slow, twos[1]):
                assert (await reader.read()).startswith(b"HTTP/1.1 408")
            await settled({"127.0.0.1": 1})  # the connection kept alive
            for _, writer in ones + twos:
                writer.close()
            await settled({})
        held = [await opened("127.0.0.1") for _ in range(3)] + [await opened("127.0.0.2") for _ in range(3)]
        await settled({"127.0.0.1": 3, "127.0.0.2": 3})
        server.close()
        await runner.cleanup()  # closes the connections still open
        await settled({})
        for _, writer in held:
            writer.close()
        await server.wait_closed()
        assert refusals.count((503, MAX_PER_CLIENT)) == 10 and refusals.count((408, SLOW_HEAD)) == 10, refusals

    asyncio.run(scenario())


def test_a_client_is_its_address_or_its_ipv6_64() -> None:
    assert client_of(("192.0.2.7", 5000)) == "192.0.2.7"
    assert client_of(("2001:db8:1:2:aaaa::1", 5000, 0, 0)) == client_of(("2001:db8:1:2:ffff::9", 1, 0, 0))
    assert client_of(("2001:db8:1:2::1", 5000, 0, 0)) != client_of(("2001:db8:1:3::1", 5000, 0, 0))
    assert client_of(("::ffff:192.0.2.7", 5000, 0, 0)) == "192.0.2.7"
    assert client_of("/run/node.sock") == ""
