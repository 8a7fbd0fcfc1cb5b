"""The worker node's trust boundaries, each tried as an attacker would (issue 49): consumer positions behind the
admin token, DNS rebinding (a Host not allowed), requests a web page sends, guessing tokens, weak tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import logstore
from logstore.errors import AuthenticationError
from logstore.node.guard import AuthLimits, AuthThrottle, HostAllowList, check_token, cross_site, host_name
from logstore.node.server import ServerConfig
from tests.harness.worker_support import NodeThread, call, worker_node

SHARDS = 8
TOKEN = "trust-boundary-token-0001"
ADMIN = "trust-boundary-admin-0001"
ROW = str(uuid.uuid4())
CELL = json.dumps({"cells": [{"row_key": ROW, "column": "BASE", "ref_key": 1, "body": {"x": 1}}]}).encode()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


JSON = {"Content-Type": "application/json"}


@pytest.fixture
def open_node(sqlite_url: str) -> Iterator[NodeThread]:
    """A node without a token: loopback only."""
    with worker_node(sqlite_url, SHARDS) as running:
        yield running


@pytest.fixture
def node(sqlite_url: str) -> Iterator[NodeThread]:
    with worker_node(sqlite_url, SHARDS, token=TOKEN, admin_token=ADMIN,
                     auth_limits=AuthLimits(client_burst=3, client_rate=0.01, overall_burst=6,
                                            overall_rate=0.01)) as running:
        yield running


# -- consumer positions -----------------------------------------------------------------------
def test_the_plain_token_cannot_take_over_or_move_a_consumers_positions(node: NodeThread) -> None:
    """The attack: claim ``app.billing`` with the ordinary token and commit past every shard's end, so the
    app skips new cells with nothing logged. Claiming and committing need the admin token now."""
    with logstore.open(node.url, token=ADMIN) as admin:
        admin.claim_offsets("app.billing", "worker-1", [0, 1])
        admin.commit_offsets("app.billing", "worker-1", {0: (5, {})})
    claim = json.dumps({"owner": "attacker", "shards": [0, 1]}).encode()
    status, doc, _ = call(node.url, "POST", "/v1/offsets/app.billing/claim", claim, JSON | bearer(TOKEN))
    assert status == 403 and "admin token" in doc["error"]["message"], doc
    commit = json.dumps({"owner": "worker-1", "offsets": {"0": {"location": 10**12, "doc": {}}}}).encode()
    status, doc, _ = call(node.url, "POST", "/v1/offsets/app.billing/commit", commit, JSON | bearer(TOKEN))
    assert status == 403, doc
    with logstore.open(node.url, token=TOKEN) as plain:
        records = plain.read_offsets("app.billing")  # reading positions stays with the token
        assert records[0].owner == "worker-1" and records[0].location == 5
        with pytest.raises(AuthenticationError, match="admin token"):
            plain.claim_offsets("app.billing", "attacker", [0])


# -- Host: DNS rebinding ----------------------------------------------------------------------
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil"])
def test_a_node_without_a_token_answers_no_rebound_host(open_node: NodeThread, host: str) -> None:
    """After DNS rebinding a page of evil.example reaches 127.0.0.1 under its own origin, with its own Host."""
    status, doc, _ = call(open_node.url, "POST", "/v1/cells", CELL, JSON | {"Host": host})
    assert status == 403 and "Host" in doc["error"]["message"], doc
    status, _, _ = call(open_node.url, "GET", "/v1/info", headers={"Host": host})
    assert status == 403
    with logstore.open(open_node.url) as store:
        assert store.get_row(uuid.UUID(ROW)) == {}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080",
                                  "node.localhost"])
def test_addresses_and_localhost_are_always_answered(open_node: NodeThread, host: str) -> None:
    status, _, _ = call(open_node.url, "GET", "/v1/info", headers={"Host": host})
    assert status == 200


def test_allowed_hosts_are_answered_and_a_token_node_answers_any_by_default(sqlite_url: str) -> None:
    with worker_node(sqlite_url, SHARDS, allowed_hosts=("cells.internal",)) as running:
        assert call(running.url, "GET", "/v1/info", headers={"Host": "cells.internal:80"})[0] == 200
        assert call(running.url, "GET", "/v1/info", headers={"Host": "other.internal"})[0] == 403
    with worker_node(sqlite_url, SHARDS, token=TOKEN) as running:
        assert call(running.url, "GET", "/v1/info", headers={"Host": "cells.internal"} | bearer(TOKEN))[0] == 200


# -- requests sent by web pages ---------------------------------------------------------------
@pytest.mark.parametrize("headers", [{"Origin": "https://evil.example"}, {"Origin": "null"},
                                     {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}])
def test_a_request_a_web_page_sent_is_refused(open_node: NodeThread, headers: dict[str, str]) -> None:
    status, doc, _ = call(open_node.url, "POST", "/v1/cells", CELL, JSON | headers)
    assert status == 403 and "web pages" in doc["error"]["message"], doc
    with logstore.open(open_node.url) as store:
        assert store.get_row(uuid.UUID(ROW)) == {}


def test_a_request_from_its_own_origin_or_typed_by_a_person_is_answered(open_node: NodeThread) -> None:
    own = open_node.url
    assert call(own, "GET", "/v1/info", headers={"Origin": own, "Sec-Fetch-Site": "same-origin"})[0] == 200
    assert call(own, "GET", "/v1/info", headers={"Sec-Fetch-Site": "none"})[0] == 200


# -- guessing tokens --------------------------------------------------------------------------
def test_a_client_guessing_tokens_is_refused_before_its_guesses_are_compared(node: NodeThread) -> None:
    for _ in range(3):
        assert call(node.url, "GET", "/v1/info", headers=bearer("wrong-token-wrong-token"))[0] == 401
    status, doc, response = call(node.url, "GET", "/v1/info", headers=bearer("wrong-token-wrong-token"))
    assert status == 429 and int(response.headers["Retry-After"]) >= 1, doc
    # The right token from that client is not compared either: a guess made now tells nothing.
    assert call(node.url, "GET", "/v1/info", headers=bearer(TOKEN))[0] == 429
    # /readyz, open, tells more to a token holder: guessing there counts the same.
    status, doc, _ = call(node.url, "GET", "/readyz", headers=bearer(TOKEN))
    assert status == 200 and set(doc["nodes"].values()) == {"ok"}
    # Another client holding the token is not held back by the guesser.
    assert call(node.url, "GET", "/v1/info", headers=bearer(TOKEN), source="127.0.0.2")[0] == 200


def test_past_the_overall_budget_only_clients_that_held_the_token_get_through(node: NodeThread) -> None:
    assert call(node.url, "GET", "/v1/info", headers=bearer(TOKEN), source="127.0.0.9")[0] == 200
    for source in ("127.0.0.2", "127.0.0.3"):  # many addresses, each within its own budget
        for _ in range(3):
            assert call(node.url, "GET", "/v1/info", headers=bearer("guess-guess-guess-guess"),
                        source=source)[0] == 401
    assert call(node.url, "GET", "/v1/info", headers=bearer(TOKEN), source="127.0.0.4")[0] == 429
    assert call(node.url, "GET", "/v1/info", headers=bearer(TOKEN), source="127.0.0.9")[0] == 200


def test_a_client_is_told_it_was_throttled_as_an_authentication_error(node: NodeThread) -> None:
    for _ in range(3):
        with pytest.raises(AuthenticationError, match="Bearer token is required"):
            logstore.open(node.url, token="wrong-token-wrong-token")
    with pytest.raises(AuthenticationError, match="too many wrong tokens"):
        logstore.open(node.url, token="wrong-token-wrong-token")


def test_the_throttle_refills_and_forgets_the_least_recent_clients() -> None:
    now = [0.0]
    throttle = AuthThrottle(AuthLimits(client_burst=2, client_rate=1.0, overall_burst=100, overall_rate=1.0,
                                       max_clients=2), clock=lambda: now[0])
    throttle.failed("a")
    throttle.failed("a")
    assert throttle.wait("a") == pytest.approx(1.0)
    now[0] = 1.0
    assert throttle.wait("a") == 0.0
    throttle.failed("b")
    throttle.failed("c")  # over max_clients: "a", the least recent, is forgotten
    assert len(throttle._clients) == 2 and "a" not in throttle._clients


# -- weak tokens ------------------------------------------------------------------------------
@pytest.mark.parametrize("token", ["short", "fifteen-chars15", "has a space in it!!", "tab\there-0123456789"])
def test_a_weak_token_is_refused(token: str) -> None:
    with pytest.raises(ValueError):
        check_token(token)
    with pytest.raises(ValueError, match="token"):
        ServerConfig(token=token)
    with pytest.raises(ValueError, match="admin token"):
        ServerConfig(token=TOKEN, admin_token=token)


def test_serve_refuses_a_weak_token_in_one_line(tmp_path: Path, sqlite_url: str) -> None:
    weak = tmp_path / "token"
    weak.write_text("letmein\n")
    done = subprocess.run([sys.executable, "-m", "cellstream", "serve", "--store", sqlite_url, "--bind",
                           "127.0.0.1:0", "--token-file", str(weak)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--token-file {weak}" in done.stderr and "at least 16 characters" in done.stderr
    assert "letmein" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# -- the parts ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("header", "name"), [("Example.COM:80", "example.com"), ("[::1]:8080", "::1"),
                                              ("::1", "::1"), ("node", "node"), ("host:notaport", "host:notaport")])
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_host_allow_list() -> None:
    hosts = HostAllowList("127.0.0.1", None, authenticated=False)
    assert hosts.allows("10.0.0.5:80") and hosts.allows("localhost") and not hosts.allows("example.com")
    assert HostAllowList("0.0.0.0", None, authenticated=True).allows("example.com")
    assert not HostAllowList("0.0.0.0", ["a.example"], authenticated=True).allows("b.example")
    assert HostAllowList("cells.internal", None, authenticated=False).allows("cells.internal:8080")


def test_cross_site() -> None:
    assert cross_site(None, None, "http://127.0.0.1:1") is None
    assert cross_site("http://127.0.0.1:1", "same-origin", "http://127.0.0.1:1") is None
    assert cross_site("http://127.0.0.1:2", None, "http://127.0.0.1:1") is not None
    assert cross_site(None, "cross-site", "http://127.0.0.1:1") is not None
