"""A worker node (logstore.node.server) on a free loopback port, run on its own event loop in a thread so
synchronous clients (logstore.open("http://..."), schemathesis) can call it from the test's thread."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import logstore
from logstore.node.server import ServerConfig, WorkerNode


class NodeThread:
    def __init__(self, store: logstore.Store, **config: Any) -> None:
        self.node = WorkerNode(store, ServerConfig(port=0, **config))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="worker-node", daemon=True)

    @property
    def url(self) -> str:
        return self.node.url

    def start(self) -> NodeThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.node.start(), self.loop).result(30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.node.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


@contextmanager
def worker_node(backing_url: str, shards: int, **config: Any) -> Iterator[NodeThread]:
    """A worker node in front of a store at ``backing_url`` (created with ``shards``)."""
    with logstore.open(backing_url, shards=shards) as store:
        node = NodeThread(store, **config).start()
        try:
            yield node
        finally:
            node.stop()


def call(url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         source: str | None = None) -> tuple[int, Any, http.client.HTTPResponse]:
    """One request to the node at ``url``: its status, its JSON answer (None when empty), the response.
    ``source``: the client's address (any of 127.0.0.0/8 is this machine on Linux)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else None, response
    finally:
        conn.close()
