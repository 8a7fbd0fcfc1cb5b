"""The logstore contract through a worker node: ``logstore.open("http://...")`` must behave as the store
behind it does (same cells, same typed errors), so apps switch between them by URL."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator

import pytest

import logstore
from logstore.node import server, wire
from tests.contracts.logstore_contract import StoreContract
from tests.harness.stores import sqlite_file
from tests.harness.worker_support import worker_node


class TestHttpStore(StoreContract):
    far_float = -1.5e18
    weighs_shards = False  # a client of a worker node plans no rebalance: the nodes' own stores do

    @pytest.fixture
    def url(self, sqlite_url: str) -> Iterator[str]:
        self.backing = sqlite_url
        with worker_node(sqlite_url, self.shards) as node:
            yield node.url

    def corrupt_body(self, url: str, cell: logstore.Cell) -> None:
        with sqlite3.connect(sqlite_file(self.backing)) as conn:
            conn.execute("UPDATE cells SET body = x'7f00' WHERE added_id = ?", (cell.added_id,))

    def shard_storage(self, url: str) -> set[int]:
        with sqlite3.connect(sqlite_file(self.backing)) as conn:
            return {s for (s,) in conn.execute("SELECT DISTINCT shard FROM cells")}

    def test_default_is_4096_shards_and_creation_is_lazy(self, url: str) -> None:
        # The node's store exists already: opened without a count, a client takes the node's.
        with logstore.open(url) as store:
            assert store.shard_count == self.shards
            assert store.get_cell(uuid.uuid4(), "BASE", 1) is None

    def test_tailing_reader_never_skips_when_commits_are_delayed_out_of_order(self, url: str) -> None:
        # The contract opens a fresh instance: here, a node in front of one.
        with worker_node(self.backing.rstrip("/") + "-fresh", self.shards) as node:
            super().test_tailing_reader_never_skips_when_commits_are_delayed_out_of_order(node.url)

    @pytest.mark.parametrize("number", [-1.5e300, 2.0**64, 2**64, -(2**63) - 1])
    def test_numbers_outside_64_bits_are_refused_naming_where(self, url: str, number: float) -> None:
        # JSON Schema cannot tell 1e300 from a 301-digit integer, so over HTTP neither is taken.
        with logstore.open(url) as store, pytest.raises(logstore.InvalidCellError) as refused:
            store.put_cells([(uuid.uuid4(), "BASE", 1, {"ok": 1}),
                             (uuid.uuid4(), "BASE", 1, {"x": [0, {"n": number}]})])
        assert (refused.value.index, refused.value.field) == (1, "body.x[1].n")

    def test_a_mark_of_another_node_process_gets_every_count(self, url: str) -> None:
        # A node's marks are its process's: after a restart (here: a second node) one is no error.
        with logstore.open(url) as store:
            store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(5)])
            mark = store.changed_counts().mark
        with worker_node(self.backing, self.shards) as other, logstore.open(other.url) as store:
            answer = store.changed_counts(mark)
            assert answer.complete and sum(answer.counts.values()) == 5
            assert not store.changed_counts(answer.mark).complete

    def test_a_node_without_the_counts_route_is_counted_whole(self, url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
        # A node of an older version: every answer complete, from /v1/shards, and no error.
        monkeypatch.setattr(server, "ROUTES", [r for r in server.ROUTES if r.path != "/v1/counts"])
        with worker_node(self.backing, self.shards) as old, logstore.open(old.url) as store:
            cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(5)])
            first = store.changed_counts()
            later = store.changed_counts(first.mark)
            assert first.complete and later.complete
            assert later.counts == {s: sum(c.shard == s for c in cells) for s in range(self.shards)}


@pytest.mark.parametrize("backend", ["mysql", "sqlite"])
def test_a_store_mark_survives_the_wire(request: pytest.FixtureRequest, backend: str) -> None:
    # A worker node sends its store's marks to clients as tokens: each backend's must come back usable.
    url = request.getfixturevalue("mysql_database" if backend == "mysql" else "sqlite_url")
    with logstore.open(url, shards=16) as store:
        mark = store.changed_counts().mark
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(8)])
        back = wire.decode_mark(wire.encode_mark(mark, "me"), "me")
        assert back == mark
        answer = store.changed_counts(back)
        assert not answer.complete
        assert {c.shard for c in cells} <= set(answer.counts)
