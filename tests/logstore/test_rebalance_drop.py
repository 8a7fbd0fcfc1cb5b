"""The drop step of a rebalance job (logstore.rebalance) deletes the source copies a chunk of shards at a time:
a shard of the chunk with no source copy (its move skipped) does not keep the others' copies."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest

import logstore
from logstore.balance import Move
from logstore.jobs import JobRunner, KindRegistry, ThrottleSettings
from logstore.nodes import add_node
from logstore.rebalance import KIND, Rebalance, job_params, rebalance_moves
from logstore.registry import url_password, without_password
from tests.harness.stores import two_nodes

SHARDS = 64


def shards_held(url: str) -> set[int]:
    """The shards of which the node's database holds cells."""
    parts = urlsplit(url)
    conn = pymysql.connect(host=parts.hostname, port=parts.port or 3306, user=parts.username,
                           password=parts.password or "", database=parts.path.lstrip("/"))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT DISTINCT shard FROM cells")
            return {int(shard) for (shard,) in cur.fetchall()}
    finally:
        conn.close()


def settled_placement(store: logstore.Store, expected: Callable[[list[str]], bool], timeout: float = 10.0) -> list[str]:
    """The store's placement once ``expected`` holds of it: a node that missed a refresh under load (one attempt,
    then skipped for two refreshes) is read again at a later one."""
    deadline = time.monotonic() + timeout
    while True:
        store.refresh_map()
        placement = store.placement()
        if expected(placement) or time.monotonic() > deadline:
            return placement
        time.sleep(0.1)


def test_a_skipped_move_does_not_keep_the_other_copies_of_its_chunk(
        mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    urls = {name: mysql_database_factory() for name in "abc"}
    monkeypatch.setenv("CST_NODE_PW", url_password(urls["c"]) or "")
    cluster = two_nodes(tmp_path / "cluster.toml", [urls["a"], urls["b"]], SHARDS)
    with logstore.open(cluster, map_refresh=0.1) as store:
        cells = store.put_cells([(uuid.uuid4(), "seed", 1, {"i": i}) for i in range(1000)])
        add_node(store, "c", without_password(urls["c"]), password_env="CST_NODE_PW")
        planned = rebalance_moves(store)
        # Where each of node a's shards goes: mostly c, and b too when the cells left b the lighter of the two.
        from_a = {m.shard: m.target for m in planned.moves if m.source == "a"}
        assert from_a
        # First among node a's shards: a move of a shard that is on its target already, never moved (skipped).
        on_b = next(s for s in range(SHARDS) if store.node_of(s) == "b" and s not in {m.shard for m in planned.moves})
        planned = planned._replace(moves=[Move(on_b, "a", "b", 0), *planned.moves])
        runner = JobRunner(store, KindRegistry([Rebalance(store)]))
        record = runner.submit(KIND, job_params(planned, "test"), throttle=ThrottleSettings())
        done = runner.run(record.id)
        assert done.state == "done" and done.steps[1].done == len(planned.moves)
        assert done.steps[0].cursor["shards"][str(on_b)]["state"] == "skipped"
        placement = settled_placement(store, lambda p: p[on_b] == "b" and all(p[s] == t for s, t in from_a.items()))
        assert placement[on_b] == "b" and {s: placement[s] for s in from_a} == from_a
        for name, url in urls.items():
            assert {s for s in shards_held(url) if placement[s] != name} == set(), f"source copies left on {name}"
        assert [store.get_cell(c.row_key, "seed", 1) for c in cells] == cells
