"""The worker node part of the demo: ``cellstream serve`` in front of the demo store (here on its own event
loop in a thread), and a client that switches to it by URL."""

from __future__ import annotations

import asyncio
import http.client
import json
import secrets
import threading
import uuid
from typing import Any, TextIO

import logstore
from logstore.node.server import ServerConfig, WorkerNode


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out, flush=True)


def _http(node: WorkerNode, method: str, path: str, body: bytes | None = None,
          token: str | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(node.config.host, int(node.url.rsplit(":", 1)[1]), timeout=10)
    try:
        conn.request(method, path, body, {"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def worker_demo(store: logstore.Store, out: TextIO, trip: uuid.UUID) -> None:
    token = secrets.token_urlsafe(16)
    node = WorkerNode(store, ServerConfig(port=0, token=token))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="demo-worker-node", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(node.start(), loop).result(30)
    try:
        _say(out, f"\n== 11. a worker node: cellstream serve --bind 127.0.0.1:0 -> {node.url} (token required)")
        with logstore.open(node.url, token=token) as remote:
            latest = remote.get_cell_latest(trip, "STATUS")
            assert latest is not None
            _say(out, f"   logstore.open({node.url!r}, token=...) reads trip {str(trip)[-12:]}: "
                      f"STATUS@{latest.ref_key} {json.dumps(latest.body)}, the same cell as the local store")
            cell = remote.put_cell(trip, "NOTES", 2, {"text": "written through the worker node"})
            assert store.get_cell(trip, "NOTES", 2) == cell
            _say(out, f"   a put through it lands in shard {cell.shard} at added_id {cell.added_id}")
            try:
                remote.put_cell(trip, "NOTES", 2, {"text": "something else"})
            except logstore.CellConflictError as exc:
                _say(out, f"   the same typed errors come back: CellConflictError: {str(exc)[:60]}...")
        status, doc = _http(node, "GET", "/v1/info")
        _say(out, f"   without the token: HTTP {status} {doc['error']['message']}")
        status, doc = _http(node, "PUT", f"/v1/rows/{trip}/NOTES/-1", b'{"text": 1}', token)
        _say(out, f"   bad input: HTTP {status} naming field {doc['error']['field']!r}: {doc['error']['problem']}")
        status, doc = _http(node, "GET", "/readyz")
        _say(out, f"   /readyz: HTTP {status} {json.dumps(doc)}; the API is described at /openapi.json")
    finally:
        asyncio.run_coroutine_threadsafe(node.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
