"""The indexer tests' store: the embedded default with 8 shards, fresh for each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import logstore

SHARDS = 8


@pytest.fixture
def store(sqlite_url: str) -> Iterator[logstore.Store]:
    with logstore.open(sqlite_url, shards=SHARDS) as opened:
        yield opened
