"""A standby mirror (logstore.mirror, ``cellstream mirror``): B holds A's cells with the same added_ids, resumes
from its own heads after a kill (never a cell twice, never one skipped), and copies consumers' offsets lowered
to what it holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from logstore.errors import ConfigurationError, InvalidArgumentError, ReadOnlyStoreError
from logstore.mirror import Mirror, mirror_lag, promote_mirror
from tests.harness import REPO
from tests.harness.stores import key_per_shard

SHARDS = 16


def whole_log(store: logstore.Store) -> list[tuple[int, int, uuid.UUID, str, int, Any, Any]]:
    """Every cell of every shard, as (shard, added_id, key, column, ref, body, created_at), in log order."""
    out = []
    for shard in range(store.shard_count):
        location = 0
        while True:
            page, location = store.get_cells_for_shard(shard, location, 500)
            if not page:
                break
            out += [(c.shard, c.added_id, c.row_key, c.column, c.ref_key, c.body, c.created_at) for c in page]
    return out


def write(store: logstore.Store, n: int, tag: str) -> None:
    keys = key_per_shard(store, range(SHARDS))
    store.put_cells([(keys[s], tag, ref, {"s": s, "ref": ref, "tag": tag}) for s in range(SHARDS)
                     for ref in range(1, n + 1)])


def test_the_mirror_holds_the_same_ids_and_resumes_from_its_own_heads(tmp_path: Any) -> None:
    with logstore.open(f"sqlite:///{tmp_path}/a", shards=SHARDS) as a, \
            logstore.open(f"sqlite:///{tmp_path}/b", shards=SHARDS) as b:
        write(a, 20, "first")
        a.claim_offsets("app.billing", "w1", range(SHARDS))
        a.commit_offsets("app.billing", "w1", {3: (a.head(3), {"n": 1})})
        mirror = Mirror(a, b, page_size=7)  # pages smaller than a shard's cells: the copy reads on
        with pytest.raises(ReadOnlyStoreError, match="standby mirror"):  # only the mirror writes to it
            b.put_cell(uuid.uuid4(), "x", 1, {})
        first = mirror.copy()
        assert first.copied == 20 * SHARDS and first.shards == SHARDS and not first.stalled
        assert whole_log(b) == whole_log(a)
        assert b.read_offsets("app.billing")[3].location == a.head(3)
        write(a, 5, "second")
        a.commit_offsets("app.billing", "w1", {3: (a.head(3), {"n": 2})})
        again = Mirror(a, b)  # a new process: it starts from B's heads
        assert again.copy().copied == 5 * SHARDS and again.copy().copied == 0
        again.copy_offsets()
        assert whole_log(b) == whole_log(a) and b.heads() == a.heads()
        assert b.read_offsets("app.billing")[3].location == a.head(3)
        assert mirror_lag(a, b).shards_behind == 0
        write(a, 1, "third")
        lag = mirror_lag(a, b)
        assert lag.shards_behind == SHARDS and lag.cells == SHARDS and lag.seconds >= 0
        a.commit_offsets("app.billing", "w1", {3: (a.head(3), {"n": 3})})
        again.copy_offsets()  # before the cells: an offset on B never passes what B holds
        assert b.read_offsets("app.billing")[3].location == b.head(3) < a.head(3)
    with logstore.open(f"sqlite:///{tmp_path}/b") as b:
        with pytest.raises(ConfigurationError, match="cannot skip ids"):  # SQLite numbers cells per node
            promote_mirror(b)
        assert promote_mirror(b, burn=0).burnt_shards == 0 and b.mirror_of() is None
        with pytest.raises(InvalidArgumentError, match="not a standby mirror"):
            promote_mirror(b, burn=0)
    with logstore.open(f"sqlite:///{tmp_path}/b") as b:
        assert b.put_cell(uuid.uuid4(), "x", 1, {}).added_id > 0  # writable after the promotion
    with logstore.open(f"sqlite:///{tmp_path}/c", shards=SHARDS * 2) as c, \
            logstore.open(f"sqlite:///{tmp_path}/a") as a, pytest.raises(ConfigurationError, match="same shard"):
        Mirror(a, c)


def test_a_mirror_killed_under_writers_resumes_and_copies_every_cell_once(mysql_database_factory: Any,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    source, target = mysql_database_factory(), mysql_database_factory()
    logstore.open(source, shards=SHARDS).close()
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        with logstore.open(source) as a:
            while not stop.is_set():
                write(a, 1, f"w{written[0]}")
                written[0] += 1

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for thread in threads:
        thread.start()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "cellstream", "mirror", "run", "--store", source, "--to", target,
                             "--page", "50"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while written[0] < 40 or not _holds_cells(target):
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-copy, mid-batch perhaps
        proc.wait(30)
        stop.set()
        for thread in threads:
            thread.join(60)
    assert main(["mirror", "run", "--once", "--store", source, "--to", target, "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["shards_behind"] == 0 and done["copied"] > 0
    with logstore.open(source) as a, logstore.open(target) as b:
        assert whole_log(b) == whole_log(a) and len(whole_log(a)) == written[0] * SHARDS
    assert main(["mirror", "status", "--store", source, "--to", target]) == 0
    assert "caught up" in capsys.readouterr().out
    with logstore.open(target) as b:
        heads = b.heads()
        with pytest.raises(ReadOnlyStoreError):
            b.put_cell(uuid.uuid4(), "x", 1, {})
    assert main(["mirror", "promote", "--to", target, "--burn", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["burnt_shards"] == SHARDS
    with logstore.open(target) as b:  # writable, and its next ids above any the source gave since
        after = b.put_cells([(k, "after", 1, {}) for k in key_per_shard(b, range(SHARDS)).values()])
        assert all(c.added_id == heads[c.shard] + 100 + 1 for c in after)


def _holds_cells(url: str) -> bool:
    try:
        # The shard count given: the mirror may be creating the target meanwhile, and a store opened
        # without it takes the default when it read no metadata yet, then finds the mirror's.
        with logstore.open(url, create=False, shards=SHARDS) as store:
            return any(store.heads().values())
    except logstore.StoreNotFoundError:
        return False
