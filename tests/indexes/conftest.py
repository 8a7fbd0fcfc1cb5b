"""The index tests' stores: clusters of two nodes (an entry and its row's locator often on different nodes), on
SQLite and on MariaDB, and the seed index's declaration file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import logstore
from tests.harness.index_support import SEED_YAML
from tests.harness.stores import two_nodes

SHARDS = 8


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    path = tmp_path / "indexes.yaml"
    path.write_text(SEED_YAML)
    return path


@pytest.fixture(params=["sqlite", "mysql"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The cluster file of two nodes of SHARDS shards in all."""
    if request.param == "sqlite":
        urls = [f"sqlite:///{tmp_path / name}" for name in ("a", "b")]
    else:
        make: Callable[[], str] = request.getfixturevalue("mysql_database_factory")
        urls = [make(), make()]
    return str(two_nodes(tmp_path / "cluster.toml", urls, SHARDS))


@pytest.fixture
def store(cluster: str) -> Iterator[logstore.Store]:
    with logstore.open(cluster) as store:
        yield store
