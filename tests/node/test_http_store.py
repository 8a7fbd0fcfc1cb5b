"""The logstore contract through a worker node: ``logstore.open("http://...")`` must behave as the store
behind it does (same cells, same typed errors), so apps switch between them by URL."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator

import pytest

import logstore
from tests.contracts.logstore_contract import StoreContract
from tests.harness.stores import sqlite_file
from tests.harness.worker_support import worker_node


class TestHttpStore(StoreContract):
    far_float = -1.5e18
    partial_counts = False  # a node over HTTP answers every shard's count

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
