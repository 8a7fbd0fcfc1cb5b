"""The read API through a worker node: the contract (tests/contracts/read_api_contract.py) with
``logstore.open("http://...")``, and what the routes add: the token, the body limit, the count of a batch, the
answer's byte budget (a batched read or a page of versions cut short, which the client reads on from), the
requests a batched read costs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import logstore
from logstore.backends.http.recorder import HttpRecorder
from logstore.node.models import MAX_READ_BATCH
from tests.contracts.read_api_contract import ReadApiContract
from tests.harness.worker_support import NodeThread, call, worker_node

TOKEN = "read-api-token-00001"
ADMIN = "read-api-admin-token-1"  # the contract writes a `_` column too
JSON = {"Content-Type": "application/json"}
BUDGET = 100_000  # the node's store's max_read_bytes in the budget tests: bodies of 40 KB, answers of 3


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def as_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELLSTREAM_TOKEN", ADMIN)


class TestHttpReadApi(ReadApiContract):
    @pytest.fixture
    def url(self, sqlite_url: str, as_admin: None) -> Iterator[str]:
        with worker_node(sqlite_url, self.shards, token=TOKEN, admin_token=ADMIN) as node:
            yield node.url

    @pytest.fixture
    def budget_url(self, sqlite_url: str, as_admin: None) -> Iterator[str]:
        with budget_node(sqlite_url, self.shards) as node:
            yield node.url


@contextmanager
def budget_node(backing: str, shards: int) -> Iterator[NodeThread]:
    """A worker node (with the tokens) whose store reads with ``max_read_bytes`` at BUDGET."""
    with logstore.open(backing, shards=shards, max_read_bytes=BUDGET) as store:
        node = NodeThread(store, token=TOKEN, admin_token=ADMIN).start()
        try:
            yield node
        finally:
            node.stop()


@pytest.fixture
def node(sqlite_url: str) -> Iterator[NodeThread]:
    with budget_node(sqlite_url, 16) as running:
        yield running


def _requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the HTTP client requests from now on."""
    sent: list[str] = []
    request = HttpRecorder._request

    def counted(self: HttpRecorder, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(f"{method} {path.partition('?')[0]}")
        return request(self, method, path, *args, **kwargs)

    monkeypatch.setattr(HttpRecorder, "_request", counted)
    return sent


def _read(node: NodeThread, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, doc, _ = call(node.url, "POST", "/v1/cells/read", raw, JSON | (bearer() if headers is None else headers))
    return status, doc


def test_the_routes_take_the_token_and_no_more(node: NodeThread) -> None:
    key = uuid.uuid4()
    with logstore.open(node.url, token=TOKEN) as store:
        store.put_cell(key, "A", 1, {"v": 1})
    wanted = {"cells": [{"row_key": str(key), "column": "A"}]}
    for path in (f"/v1/versions/{key}/A", f"/v1/rows/{key}/A?as_of=2099-01-01T00:00:00Z",
                 f"/v1/rows/{key}?as_of=2099-01-01T00:00:00Z"):
        assert call(node.url, "GET", path)[0] == 401
        assert call(node.url, "GET", path, headers=bearer("not-the-token-at-all"))[0] == 401
        assert call(node.url, "GET", path, headers=bearer())[0] == 200
    assert _read(node, wanted, {})[0] == 401
    status, doc = _read(node, wanted)
    assert status == 200 and doc["cells"][0]["body"] == {"v": 1} and "truncated" not in doc


@pytest.mark.parametrize(("body", "field"), [
    ({"cells": []}, "cells"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A"}] * (MAX_READ_BATCH + 1)}, "cells"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A"}, {"row_key": "x", "column": "A"}]},
     "cells.1.row_key"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A b"}]}, "cells.0.column"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A", "ref_key": -1}]}, "cells.0.ref_key"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A", "ref_key": 2**63}]}, "cells.0.ref_key"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A", "at": 1}]}, "cells.0.at"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A"}], "as_of": "2026-01-01T00:00:00"}, "as_of"),
    ({"cells": [{"row_key": str(uuid.UUID(int=1)), "column": "A"}], "max_bytes": 0}, "max_bytes"),
])
def test_a_bad_batched_read_is_refused_naming_the_field(node: NodeThread, body: Any, field: str) -> None:
    status, doc = _read(node, body)
    assert status == 400 and doc["error"]["field"] == field, doc


def test_a_batched_read_over_the_body_limit_gets_413(sqlite_url: str) -> None:
    with worker_node(sqlite_url, 16, max_body_bytes=64 * 1024) as small:
        wanted = {"cells": [{"row_key": str(uuid.uuid4()), "column": "A" * 60, "ref_key": 2**62}] * 900}
        status, doc, _ = call(small.url, "POST", "/v1/cells/read", json.dumps(wanted).encode(), JSON)
    assert status == 413, doc


def test_versions_and_batches_hold_to_the_answer_budget_and_the_client_reads_on(
        node: NodeThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies of 40 KB against the node's 100 KB: a batch of 8 is answered 3 at a time (truncated), a page of
    versions too, with `next`; a client gets all 8 in 3 requests, and its pages of versions are TruncatedPages."""
    key = uuid.uuid4()
    with logstore.open(node.url, token=TOKEN) as store:
        cells = store.put_cells([(key, "A", r, {"s": chr(97 + r) * 40_000}) for r in range(8)])
        wanted = [{"row_key": str(key), "column": "A", "ref_key": r} for r in range(8)]
        status, doc = _read(node, {"cells": wanted})
        assert status == 200 and doc["truncated"] is True and [c["ref_key"] for c in doc["cells"]] == [0, 1, 2]
        status, doc = _read(node, {"cells": wanted, "max_bytes": 50_000})  # the client's budget, below the node's
        assert status == 200 and doc["truncated"] is True and len(doc["cells"]) == 2
        status, doc, _ = call(node.url, "GET", f"/v1/versions/{key}/A?limit=50", headers=bearer())
        assert [c["ref_key"] for c in doc["cells"]] == [7, 6, 5] and (doc["next"], doc["truncated"]) == (5, True)
        status, doc, _ = call(node.url, "GET", f"/v1/versions/{key}/A?before=2&limit=50", headers=bearer())
        assert [c["ref_key"] for c in doc["cells"]] == [1, 0] and doc["next"] is None and "truncated" not in doc
        status, doc, _ = call(node.url, "GET", f"/v1/versions/{key}/A?before=4&limit=2", headers=bearer())
        assert [c["ref_key"] for c in doc["cells"]] == [3, 2] and doc["next"] == 2  # a full page: read on
        sent = _requests(monkeypatch)
        assert store.get_cells([(key, "A", r) for r in range(8)]) == cells
        assert sent == ["POST /v1/cells/read"] * 3


def test_a_batch_larger_than_a_request_takes_is_sent_in_parts(sqlite_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with worker_node(sqlite_url, 16) as running, logstore.open(running.url) as store:
        keys = [uuid.uuid4() for _ in range(1200)]
        cells = store.put_cells([(k, "A", 1, {"i": i}) for i, k in enumerate(keys)])
        sent = _requests(monkeypatch)
        assert store.get_cells_latest([(k, "A") for k in keys] * 2) == cells * 2
        assert store.get_cells([(k, "A", 1) for k in keys[:10]]) == cells[:10]
    assert sent == ["POST /v1/cells/read"] * 4  # 2,400 coordinates, 1,000 a request; then 10
