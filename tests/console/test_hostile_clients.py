"""The console against clients that hold connections: heads and bodies trickled in, more connections than it
takes, one client address taking them all. It has the worker node's limits, answered in plain text."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import requests
from pydantic import SecretStr

from cellstream.console import Console
from cellstream.console.server import FORM_MAX_BYTES
from tests.console.support import TriageApp, serving, triage_app

TOKEN = "console-token-hostile-0123456789"


@pytest.fixture(scope="module")
def billing(tmp_path_factory: pytest.TempPathFactory) -> TriageApp:
    return triage_app(tmp_path_factory.mktemp("hostile"), bills=3, notes=0)


@pytest.fixture
def console(billing: TriageApp) -> Iterator[Console]:
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN), header_timeout=0.5, body_timeout=0.5) as running:
        yield running


def connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10, source_address=(source, 0))


def read_response(sock: socket.socket, limit: float = 5.0) -> tuple[int, dict[str, str], str]:
    """The whole answer of a connection the console closes: status, headers, body."""
    sock.settimeout(limit)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body.decode()


def refusals(console: Console, status: int, reason: str) -> float:
    value = console.metrics.registry.get_sample_value("cellstream_console_connection_errors_total",
                                                       {"status": str(status), "reason": reason})
    return value or 0.0


def test_heads_trickled_in_are_cut_off_at_the_deadline(console: Console) -> None:
    socks = [connect(console.url) for _ in range(10)]
    for sock in socks:
        sock.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        sock.settimeout(0.01)
    started = time.monotonic()
    answers: dict[socket.socket, bytes] = {}
    try:
        while len(answers) < len(socks) and time.monotonic() - started < 5:
            for sock in socks:
                if sock not in answers:
                    try:
                        sock.sendall(b"a")  # one more byte every 0.1 s
                        answers[sock] = sock.recv(65536)
                    except TimeoutError:
                        continue
                    except OSError:
                        answers[sock] = b""
            time.sleep(0.1)
        assert len(answers) == len(socks), f"{len(socks) - len(answers)} connections still open after 5 s"
    finally:
        for sock in socks:
            sock.close()
    assert all(data.startswith(b"HTTP/1.1 408 ") for data in answers.values()), set(answers.values())
    assert all(b"text/plain" in data and b"did not arrive within 0.5 s" in data for data in answers.values())
    assert refusals(console, 408, "slow_head") == len(socks)


def test_a_form_that_does_not_arrive_is_answered_408(console: Console) -> None:
    with connect(console.url) as sock:
        sock.sendall(b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                     b"Content-Length: 1000\r\n\r\nname=bob&token=")
        started = time.monotonic()
        status, _, body = read_response(sock)
    assert status == 408 and "body did not arrive within 0.5 s" in body
    assert time.monotonic() - started < 3


def test_a_form_larger_than_a_form_is_refused(console: Console) -> None:
    r = requests.post(console.url + "/login", data={"name": "bob", "token": "x" * FORM_MAX_BYTES}, timeout=10)
    assert r.status_code == 413


def test_a_connection_over_the_cap_is_answered_503(billing: TriageApp) -> None:
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN), max_connections=3) as console:
        held = [connect(console.url) for _ in range(3)]
        try:
            time.sleep(0.2)  # the three are accepted before the fourth
            with connect(console.url) as extra:
                status, headers, body = read_response(extra)
        finally:
            for sock in held:
                sock.close()
        assert status == 503 and headers["retry-after"] == "1" and headers["content-type"].startswith("text/plain")
        assert "the console is at its limit of 3 connections" in body
        assert refusals(console, 503, "max_connections") == 1


def test_one_client_address_cannot_take_every_connection(billing: TriageApp) -> None:
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN), max_connections=20,
                 max_connections_per_client=4, header_timeout=30.0) as console:
        held = [connect(console.url) for _ in range(20)]  # as many as the console takes, from 127.0.0.1
        try:
            for sock in held[:4]:
                sock.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head never finished
            for sock in held[4:]:
                status, headers, body = read_response(sock)
                assert status == 503 and headers["retry-after"] == "1"
                assert "limit of 4 connections per client" in body
            for _ in range(3):  # another client address is answered
                with connect(console.url, source="127.0.0.2") as other:
                    other.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    status, _, body = read_response(other)
                assert status == 200 and '"ok"' in body
        finally:
            for sock in held:
                sock.close()
        assert refusals(console, 503, "max_connections_per_client") == 16


def test_cellstream_console_takes_the_limits_as_options(billing: TriageApp) -> None:
    argv = [sys.executable, "-m", "cellstream", "console", "--app", billing.spec, "--bind", "127.0.0.1:0",
            "--max-connections", "2", "--header-timeout", "0.5", "--json"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "CELLSTREAM_CONSOLE_TOKEN": TOKEN})
    try:
        assert process.stdout is not None
        url = json.loads(process.stdout.readline())["url"]
        held = [connect(url) for _ in range(2)]
        try:
            time.sleep(0.2)
            with connect(url) as extra:
                assert read_response(extra)[0] == 503
            started = time.monotonic()
            assert read_response(held[0])[0] == 408 and time.monotonic() - started < 3
        finally:
            for sock in held:
                sock.close()
    finally:
        process.kill()
        process.wait()
