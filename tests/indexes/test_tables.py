"""The index-table contract on SQLite and MariaDB, on one node and on two."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import logstore
from tests.contracts.index_contract import SHARDS, IndexContract
from tests.harness.stores import two_nodes


class TestSQLiteIndexes(IndexContract):
    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> None:
        self.tmp = tmp_path

    def open_store(self, nodes: int) -> logstore.Store:
        if nodes == 1:
            return logstore.open(f"sqlite:///{self.tmp / 'one'}", shards=SHARDS)
        urls = [f"sqlite:///{self.tmp / name}" for name in ("a", "b")]
        return logstore.open(two_nodes(self.tmp / "cluster.toml", urls, SHARDS))


class TestMySQLIndexes(IndexContract):
    @pytest.fixture(autouse=True)
    def _databases(self, mysql_database_factory: Callable[[], str], tmp_path: Path) -> None:
        self.make = mysql_database_factory
        self.tmp = tmp_path

    def open_store(self, nodes: int) -> logstore.Store:
        if nodes == 1:
            return logstore.open(self.make(), shards=SHARDS)
        return logstore.open(two_nodes(self.tmp / "cluster.toml", [self.make(), self.make()], SHARDS))
