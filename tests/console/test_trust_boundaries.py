"""The console's trust boundaries, tried as an attacker would (issue 49): DNS rebinding onto a console without a
token, posts a web page sends, guessing the token at the login and at /metrics, weak tokens."""

from __future__ import annotations

import http.client
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from cellstream.console import Console, ConsoleConfig
from logstore.node.guard import AuthLimits
from tests.console.support import TriageApp, serving, triage_app

TOKEN = "console-trust-token-0001"


@pytest.fixture
def billing(tmp_path: Path) -> TriageApp:
    return triage_app(tmp_path)


@pytest.fixture
def open_console(billing: TriageApp) -> Iterator[Console]:
    with serving({"billing": billing.queue}) as running:
        yield running


@pytest.fixture
def console(billing: TriageApp) -> Iterator[Console]:
    limits = AuthLimits(client_burst=3, client_rate=0.01, overall_burst=100, overall_rate=0.01)
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN), auth_limits=limits) as running:
        yield running


def call(console: Console, method: str, path: str, form: dict[str, str] | None = None,
         headers: dict[str, str] | None = None, source: str | None = None) -> tuple[int, str, dict[str, str]]:
    parts = urllib.parse.urlsplit(console.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30,
                                      source_address=(source, 0) if source else None)
    body = urllib.parse.urlencode(form).encode() if form is not None else None
    sent = dict(headers or {})
    if body is not None:
        sent.setdefault("Content-Type", "application/x-www-form-urlencoded")
    try:
        conn.request(method, path, body, sent)
        response = conn.getresponse()
        return response.status, response.read().decode(), dict(response.getheaders())
    finally:
        conn.close()


def test_a_console_without_a_token_answers_no_rebound_host(open_console: Console) -> None:
    """The reproduced attack: a page of evil.example, rebound to 127.0.0.1, logged in (no token asked) and
    discarded a dead letter. Its requests carry Host: evil.example."""
    status, text, _ = call(open_console, "POST", "/login", {"name": "mallory"}, {"Host": "evil.example:8090"})
    assert status == 403 and "Host" in text
    assert call(open_console, "GET", "/login", headers={"Host": "evil.example"})[0] == 403
    status, _, headers = call(open_console, "POST", "/login", {"name": "carol"}, {"Host": "localhost"})
    assert status == 303 and "cellstream_console" in headers.get("Set-Cookie", "")


@pytest.mark.parametrize("marks", [{"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                                   {"Origin": "http://127.0.0.1:1"}])
def test_a_post_a_web_page_sent_is_refused(open_console: Console, marks: dict[str, str]) -> None:
    status, text, headers = call(open_console, "POST", "/login", {"name": "mallory"}, marks)
    assert status == 403 and "Set-Cookie" not in headers, text


def test_a_client_guessing_the_token_is_refused_before_it_is_compared(console: Console) -> None:
    for _ in range(3):
        assert call(console, "POST", "/login", {"name": "m", "token": "guess-guess-guess-1"})[0] == 401
    status, text, headers = call(console, "POST", "/login", {"name": "m", "token": TOKEN})
    assert status == 429 and int(headers["Retry-After"]) >= 1 and "too many wrong tokens" in text
    status, _, headers = call(console, "POST", "/login", {"name": "bob", "token": TOKEN}, source="127.0.0.2")
    assert status == 303 and "cellstream_console" in headers["Set-Cookie"]


def test_guesses_at_metrics_count_the_same(console: Console) -> None:
    for _ in range(3):
        assert call(console, "GET", "/metrics", headers={"Authorization": "Bearer guess-guess-guess-1"})[0] == 303
    status, _, headers = call(console, "GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 429 and "Retry-After" in headers
    assert call(console, "POST", "/login", {"name": "m", "token": TOKEN})[0] == 429
    status, text, _ = call(console, "GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                           source="127.0.0.2")
    assert status == 200 and 'cellstream_console_logins_total{result="throttled"} 2.0' in text


def test_a_weak_console_token_is_refused(billing: TriageApp, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="at least 16 characters"):
        ConsoleConfig(token=SecretStr("hunter2"))
    weak = tmp_path / "token"
    weak.write_text("hunter2\n")
    done = subprocess.run([sys.executable, "-m", "cellstream", "console", "--app", billing.spec, "--bind",
                           "127.0.0.1:0", "--token-file", str(weak)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least 16 characters" in done.stderr, done.stderr
    assert "hunter2" not in done.stderr
