"""The worker node itself: auth, limits, every bad input a 4xx JSON error naming the field (never a 500),
a storage node lost behind it (503, readiness), metrics, and ``cellstream serve`` as a process."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import logstore
from logstore.node.server import ServerConfig, WorkerNode
from logstore.retry import RetryPolicy
from tests.harness.faults import TcpProxy
from tests.harness.worker_support import NodeThread, call, worker_node

SHARDS = 8
TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def node(sqlite_url: str) -> Iterator[NodeThread]:
    with worker_node(sqlite_url, SHARDS, max_body_bytes=64 * 1024) as running:
        yield running


ROW = str(uuid.uuid4())
BAD_INPUT = [
    ("PUT", "/v1/rows/not-a-uuid/BASE/1", b'{"a":1}', 400, "row_key"),
    ("PUT", f"/v1/rows/{ROW}/9bad/1", b'{"a":1}', 400, "column"),
    ("PUT", f"/v1/rows/{ROW}/_offsets/1", b'{"a":1}', 400, "column"),
    ("PUT", f"/v1/rows/{ROW}/BASE/-1", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1.5", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/99999999999999999999", b'{"a":1}', 400, "ref_key"),
    # int() takes all of these; a path integer is ASCII digits only, without sign, underscore or padding.
    ("PUT", f"/v1/rows/{ROW}/BASE/1_000", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/+7", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/%D9%A1", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/%EF%BC%92", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/%203", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/01", b'{"a":1}', 400, "ref_key"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1", b'[1, 2]', 400, "body"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1", b'{"a": NaN}', 400, "body"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1", b'{"a": ', 400, "body"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1", b'', 400, "body"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1", b'{"a": 1e999999}', 400, "body.a"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1", b'{"n": 36893488147419103232}', 400, "body.n"),
    ("PUT", f"/v1/rows/{ROW}/BASE/1", b'{"a":' * 2000 + b'1' + b'}' * 2000, 400, "body"),
    ("POST", "/v1/cells", b'{"cells": []}', 400, "cells"),
    ("POST", "/v1/cells", b'{"cells": [{"row_key": "x", "column": "BASE", "ref_key": 1, "body": {}}]}', 400,
     "cells.0.row_key"),
    ("POST", "/v1/cells", f'{{"cells": [{{"row_key": "{ROW}", "column": "BASE", "ref_key": true, "body": {{}}}}]}}'
     .encode(), 400, "cells.0.ref_key"),
    ("POST", "/v1/cells", f'{{"cells": [{{"row_key": "{ROW}", "column": "BASE", "ref_key": 1, "body": {{}}, '
     f'"extra": 1}}]}}'.encode(), 400, "cells.0.extra"),
    ("GET", "/v1/shards/8/log", None, 400, "shard"),
    ("GET", "/v1/shards/-1", None, 400, "shard"),
    ("GET", "/v1/shards/x/log", None, 400, "shard"),
    ("GET", "/v1/shards/0/log?limit=0", None, 400, "limit"),
    ("GET", "/v1/shards/0/log?limit=-1", None, 400, "limit"),
    ("GET", "/v1/shards/0/log?limit=%2B5", None, 400, "limit"),
    ("GET", "/v1/shards/0/log?after=-1", None, 400, "after"),
    ("GET", "/v1/shards/007/log", None, 400, "shard"),
    ("GET", "/v1/shards/0/log?columns=9x", None, 400, "columns"),
    ("GET", "/v1/shards/0/log?limt=5", None, 400, "limt"),
    ("GET", f"/v1/rows/{ROW}/BASE?ref=1", None, 400, "ref"),
    ("GET", "/v1/shards/0/location?at=yesterday", None, 400, "at"),
    ("GET", "/v1/shards/0/location?at=2026-11-22T10:00:00", None, 400, "at"),
    ("POST", "/v1/logs", b'{"locations": {"0": -1}}', 400, "locations.0"),
    ("POST", "/v1/logs", b'{"locations": {"8": 0}}', 400, "locations.8"),
    ("POST", "/v1/logs", b'{"locations": {"zero": 0}}', 400, "locations.zero"),
    ("POST", "/v1/offsets/app/commit", b'{"owner": "me", "offsets": {"0": {"location": -5}}}', 400,
     "offsets.0.location"),
    ("GET", "/v1/counts?since=a%2Bb", None, 400, "since"),
    ("GET", "/v1/counts?since=", None, 400, "since"),
    ("GET", f"/v1/rows/{ROW}/BASE/1", None, 404, None),
    ("GET", "/v2/anything", None, 404, None),
    ("DELETE", f"/v1/rows/{ROW}/BASE/1", None, 405, None),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "field"), BAD_INPUT,
                         ids=[f"{m} {p[:40]} {(b or b'')[:20]!r}" for m, p, b, _, _ in BAD_INPUT])
def test_bad_input_is_a_4xx_json_error_naming_the_field(node: NodeThread, method: str, path: str,
                                                        body: bytes | None, status: int, field: str | None) -> None:
    got, doc, response = call(node.url, method, path, body, {"Content-Type": "application/json"})
    assert got == status, doc
    assert response.getheader("Content-Type", "").startswith("application/json")
    assert set(doc["error"]) >= {"type", "message", "retriable"} and doc["error"]["retriable"] is False
    assert "Traceback" not in json.dumps(doc)
    if field is not None:
        assert doc["error"]["field"] == field, doc
    with logstore.open(node.url) as store:  # nothing of a refused write was stored
        assert store.get_row(ROW) == {}


def test_a_body_over_the_limit_is_refused_with_413(node: NodeThread) -> None:
    big = json.dumps({"cells": [{"row_key": ROW, "column": "BASE", "ref_key": 1, "body": {"x": "y" * 70_000}}]})
    status, doc, _ = call(node.url, "POST", "/v1/cells", big.encode(), {"Content-Type": "application/json"})
    assert status == 413 and doc["error"]["type"] == "HTTPError"
    with logstore.open(node.url) as store:
        assert store.get_row(ROW) == {}


def test_with_a_token_every_request_needs_it(sqlite_url: str) -> None:
    with worker_node(sqlite_url, SHARDS, token=TOKEN) as node:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            status, doc, response = call(node.url, "GET", "/v1/info", headers=headers)
            assert status == 401 and doc["error"]["type"] == "HTTPError"
            assert response.getheader("WWW-Authenticate", "").startswith("Bearer")
        assert call(node.url, "GET", "/healthz")[0] == 200  # probes stay open
        assert call(node.url, "GET", "/readyz")[0] == 200
        assert call(node.url, "GET", "/v1/info", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        with pytest.raises(logstore.ConfigurationError, match="refused"):
            logstore.open(node.url)
        with logstore.open(node.url, token=TOKEN) as store:
            cell = store.put_cell(ROW, "BASE", 1, {"ok": True})
            assert store.get_cell_latest(ROW, "BASE") == cell


def test_without_a_token_it_binds_only_to_loopback(sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        with pytest.raises(logstore.ConfigurationError, match="loopback"):
            WorkerNode(store, ServerConfig(host="0.0.0.0", port=0))
        WorkerNode(store, ServerConfig(host="0.0.0.0", port=0, token=TOKEN))  # with one it may


@pytest.mark.parametrize("token", ["bm90IGpzb24", "WzEsMl0", "WyJ4Il0", "W10", "x" * 4000])
def test_counts_since_a_token_the_node_never_gave_are_every_shards(node: NodeThread, token: str) -> None:
    # base64url of "not json", [1,2], ["x"], []: every count is the right answer to a mark not understood.
    with logstore.open(node.url) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(20)])
    status, doc, _ = call(node.url, "GET", "/v1/counts")
    assert status == 200 and doc["complete"] is True
    status, again, _ = call(node.url, "GET", f"/v1/counts?since={doc['mark']}")
    assert status == 200 and again["complete"] is False  # the node's own mark: a partial answer
    status, doc, _ = call(node.url, "GET", f"/v1/counts?since={token}")
    assert status == 200 and doc["complete"] is True
    assert dict(zip(doc["shards"], doc["cells"], strict=True)) == {
        s: sum(c.shard == s for c in cells) for s in range(SHARDS)}


def test_the_index_tables_stay_the_nodes(node: NodeThread) -> None:
    # queries go through the node (tests/indexes/test_http_queries.py); creating or applying does not
    with logstore.open(node.url) as store, pytest.raises(logstore.ConfigurationError, match="are the node's"):
        store.indexes  # noqa: B018


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_lost_storage_node_is_503_retriable_and_not_ready(mysql_database: str, token: str | None) -> None:
    """/readyz says which storage node does not answer; what it answered (its host, the driver's error) only
    to a token holder, since the route is open to anyone who reaches the node."""
    parts = urlsplit(mysql_database)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    with TcpProxy(parts.hostname or "", parts.port or 3306) as proxy:
        behind = mysql_database.replace(f":{parts.port}/", f":{proxy.port}/")
        quick = RetryPolicy(initial=0.05, maximum=0.2, deadline=1.0)
        with logstore.open(behind, shards=SHARDS, retry=quick, connect_timeout=1.0, read_timeout=2.0) as store:
            node = NodeThread(store, token=token).start()
            try:
                with logstore.open(node.url, token=token) as client:
                    client.put_cell(ROW, "BASE", 1, {"before": True})
                    proxy.cut()
                    with pytest.raises(logstore.StorageUnavailableError) as caught:
                        client.put_cell(ROW, "BASE", 2, {"during": True})
                    assert caught.value.retriable
                    status, doc, response = call(node.url, "GET", f"/v1/rows/{ROW}/BASE", headers=auth)
                    assert status == 503 and doc["error"]["retriable"] is True
                    assert response.getheader("Retry-After") == "1"
                    status, doc, _ = call(node.url, "GET", "/readyz", headers=auth)
                    assert status == 503 and doc["ready"] is False and doc["nodes"]["node0"] != "ok"
                    assert "MySQL" in doc["nodes"]["node0"]  # what the storage node answered, in full
                    if token is not None:
                        status, doc, _ = call(node.url, "GET", "/readyz")
                        assert status == 503 and doc == {"ready": False, "nodes": {"node0": "unavailable"}}
                    # What the "worker node not ready" alert reads, at each scrape.
                    assert 'cellstream_worker_storage_node_up{node="node0"} 0.0' in metrics_of(node.url, auth)
                    proxy.restore()
                    deadline = time.monotonic() + 30
                    while call(node.url, "GET", "/readyz")[0] != 200:
                        assert time.monotonic() < deadline, "the node never became ready again"
                        time.sleep(0.2)
                    assert client.put_cell(ROW, "BASE", 2, {"during": True}).ref_key == 2
                    assert 'cellstream_worker_storage_node_up{node="node0"} 1.0' in metrics_of(node.url, auth)
            finally:
                node.stop()


def metrics_of(url: str, headers: dict[str, str] | None = None) -> str:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers or {})
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_metrics_count_requests_by_route_and_status(node: NodeThread) -> None:
    with logstore.open(node.url) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(3)])
        store.get_cell_latest(ROW, "BASE")
    call(node.url, "GET", "/v1/shards/x/log")
    parts = urlsplit(node.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    assert 'cellstream_worker_requests_total{method="POST",route="/v1/cells",status="200"} 1.0' in text
    assert 'route="/v1/rows/{row_key}/{column}",status="404"} 1.0' in text
    assert 'route="/v1/shards/{shard}/log",status="400"} 1.0' in text
    assert "cellstream_worker_cells_written_total 3.0" in text
    assert 'cellstream_build_info{component="worker-node"' in text
    assert 'cellstream_worker_request_seconds_bucket{le="0.005",route="/v1/cells"}' in text


def serve(store: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cellstream", "serve", "--store", store, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def test_cellstream_serve_runs_until_sigterm(sqlite_url: str, tmp_path: Path) -> None:
    with logstore.open(sqlite_url, shards=SHARDS):
        pass
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    process = serve(sqlite_url, "--bind", "127.0.0.1:0", "--token-file", str(token_file), "--json")
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline())
        assert started["token_required"] is True
        with logstore.open(started["url"], token=TOKEN) as client:
            assert client.shard_count == SHARDS
            client.put_cell(ROW, "BASE", 1, {"via": "cli"})
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert TOKEN not in (process.stderr.read() if process.stderr else "")
    finally:
        process.kill()
    with logstore.open(sqlite_url) as store:
        assert store.get_cell(ROW, "BASE", 1) is not None


@pytest.mark.parametrize(("args", "message"), [
    (["--bind", "0.0.0.0:0"], "without a token the worker node listens only on loopback"),
    (["--bind", "nowhere"], "expected HOST:PORT"),
    (["--token-file", "/nonexistent/token"], "--token-file"),
])
def test_cellstream_serve_refuses_with_one_line(sqlite_url: str, args: list[str], message: str) -> None:
    process = serve(sqlite_url, *args, env={"CELLSTREAM_TOKEN": ""})
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 2, err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(("path", "problem"), [
    ("/v1/shards/0/log?limit=%2B5", "'+5' is not an integer in ASCII digits"),
    ("/v1/shards/0/location?at=yesterday", "'yesterday' is not an RFC 3339 time with a UTC offset"),
    ("/v1/shards/0/location?at=2026-02-30T00:00:00Z", "'2026-02-30T00:00:00Z' is not a valid time: day"),
])
def test_a_refusal_quotes_what_was_sent(node: NodeThread, path: str, problem: str) -> None:
    status, doc, _ = call(node.url, "GET", path)
    assert status == 400 and doc["error"]["problem"].startswith(problem), doc


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_labelled_json_is_refused_so_no_web_page_writes_to_a_loopback_node(
    node: NodeThread, content_type: str | None
) -> None:
    """A cross-site POST from any web page the user visits reaches a node on 127.0.0.1 without a CORS
    preflight only as text/plain, a form or multipart: with no token on loopback, it had written cells."""
    body = json.dumps({"cells": [{"row_key": ROW, "column": "BASE", "ref_key": 1, "body": {"x": 1}}]}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    status, doc, _ = call(node.url, "POST", "/v1/cells", body, headers)
    assert status == 415 and doc["error"]["type"] == "UnsupportedMediaType", doc
    with logstore.open(node.url) as store:
        assert store.get_row(ROW) == {}


def test_metrics_show_the_store_jobs_a_dead_runner_left(node: NodeThread) -> None:
    """The alerts on failed and runner-less jobs read the records through the node's /metrics: a job whose
    runner died has nobody else to export it."""
    from logstore.jobs import JobStore, StepRecord

    jobs = JobStore(node.node.store)
    waiting = jobs.create("compact", {}, [StepRecord(name="BASE/date=2026-11-25", total=4)], unit="files")
    failed = jobs.create("compact", {}, [StepRecord(name="FARE/date=2026-11-25")], unit="files")
    jobs.change(failed.id, lambda record: setattr(record, "state", "failed"))
    deadline = time.monotonic() + 10  # the records are read in the background (every health_interval), not by a scrape
    while f'cellstream_job_failed{{job_id="{failed.id}",kind="compact"}} 1.0' not in (text := metrics_of(node.url)):
        assert time.monotonic() < deadline, "the node's metrics never showed the jobs"
        time.sleep(0.1)
    assert f'cellstream_job_failed{{job_id="{failed.id}",kind="compact"}} 1.0' in text
    assert f'cellstream_job_lease_lapsed_seconds{{job_id="{waiting.id}",kind="compact"}}' in text
    assert 'cellstream_jobs{kind="compact",state="planned"} 1.0' in text
