"""The MySQL write path of a batch over many shards (issue 51, point 5): one UPDATE locks the shards' rows and
moves their counters, refusing a fenced row, so the fence, the ids, ``created_at`` and ``touched`` keep their
guarantees with one statement fewer per batch."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pymysql
import pytest

import logstore
from logstore.backends.mysql.recorder import TOUCH_MARGIN
from logstore.backends.mysql.target import MySQLTarget
from logstore.cell import compress, pack_body
from logstore.config import parse_node_url
from logstore.persistence import PendingCell
from tests.contracts.logstore_contract import store_recorders
from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.stores import keys_in_shard


def _connect(url: str) -> pymysql.connections.Connection:
    t = parse_node_url(url)
    assert isinstance(t, MySQLTarget)
    return pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password, database=t.database,
                           autocommit=True)


def _pending(store: logstore.Store, key: uuid.UUID, body: dict[str, Any]) -> PendingCell:
    return PendingCell(store.shard_of(key), key, "BASE", 1, body, compress(pack_body(body, 1 << 20), 6))


def _logs(store: logstore.Store) -> dict[int, list[logstore.Cell]]:
    out: dict[int, list[logstore.Cell]] = {}
    for shard in range(store.shard_count):
        cells, _ = store.get_cells_for_shard(shard, 0, 100_000)
        if cells:
            out[shard] = cells
    return out


def _assert_dense_and_ordered(store: logstore.Store, written: list[logstore.Cell]) -> None:
    """Every shard's ids are 1..n with created_at never decreasing along them, its head and count say n, and
    every written cell is stored with the id and time it was given."""
    logs = _logs(store)
    for shard, cells in logs.items():
        assert [c.added_id for c in cells] == list(range(1, len(cells) + 1)), f"shard {shard}: ids not dense"
        times = [c.created_at for c in cells]
        assert times == sorted(times), f"shard {shard}: created_at decreases along the ids"
        assert store.head(shard) == len(cells)
    assert store.cell_counts() == {s: len(logs.get(s, [])) for s in range(store.shard_count)}
    stored = {(c.shard, c.added_id): c for cells in logs.values() for c in cells}
    for cell in written:
        assert stored[cell.shard, cell.added_id] == cell


def test_a_batch_meeting_a_fenced_or_missing_shard_writes_nothing_and_moves_no_counter(mysql_database: str) -> None:
    with logstore.open(mysql_database, shards=64) as store:
        [recorder] = store_recorders(store)
        first = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(100)])
        used = {c.shard for c in first}
        # Empty shards: a refused row's counter (0) would give ids 0 and below instead of a duplicate error.
        fenced, missing = [s for s in range(64) if s not in used][:2]
        heads = store.heads()
        with _connect(mysql_database) as conn, conn.cursor() as cur:
            cur.execute("UPDATE cellstream_shards SET fence = 'elsewhere' WHERE shard = %s", (fenced,))
        keys = [k for s in sorted(used)[:5] for k in keys_in_shard(store, s, 2)] + keys_in_shard(store, fenced, 1)
        batch = [_pending(store, k, {"n": n}) for n, k in enumerate(keys)]
        with pytest.raises(logstore.ShardMovedError) as refused:
            recorder.insert(batch)
        assert (refused.value.shard, refused.value.node) == (fenced, "elsewhere")
        assert store.heads() == heads and all(store.get_cell(k, "BASE", 1) is None for k in keys)

        with _connect(mysql_database) as conn, conn.cursor() as cur:
            cur.execute("UPDATE cellstream_shards SET fence = NULL WHERE shard = %s", (fenced,))
            cur.execute("DELETE FROM cellstream_shards WHERE shard = %s", (missing,))
        without = [*batch[:-1], _pending(store, keys_in_shard(store, missing, 1)[0], {"n": "missing"})]
        with pytest.raises(logstore.StorageError, match="does not hold"):
            recorder.insert(without)
        assert store.heads() == heads
        assert all(store.get_cell(c.row_key, "BASE", 1) is None for c in without)

        # The fence lifted, the same batch goes in, its ids right after the counters it met.
        written = recorder.insert(batch)
        assert [c.added_id for c in written if c.shard == fenced] == [1]
        _assert_dense_and_ordered(store, [*first, *written])


def test_a_batch_too_large_for_one_insert_moves_the_counters_after_it(
        mysql_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``touched`` is set by the statement that moves a counter; a count poll only sees commits within
    TOUCH_MARGIN of it. A batch of one INSERT moves the counters first (the statement takes the locks); a
    larger one, whose INSERTs may take long, moves them last, just before the COMMIT."""
    import logstore.backends.mysql.recorder as backend
    from logstore.backends.mysql.pool import run_script as original

    scripts: list[list[str]] = []

    def spy(cur: Any, script: Any) -> Any:
        scripts.append([sql.split(" (")[0][:40] for sql, _ in script])
        return original(cur, script)

    def kinds() -> list[str]:
        flat = [s for script in scripts for s in script]
        return [("counters" if s.startswith("UPDATE cellstream_shards") else "insert" if s.startswith("INSERT")
                 else "other") for s in flat]

    monkeypatch.setattr(backend, "run_script", spy)
    with logstore.open(mysql_database, shards=64, max_statement_bytes=64 * 1024) as store:
        time.sleep(TOUCH_MARGIN + 0.1)  # the rows created with the node are older than a look's margin
        mark = store.changed_counts().mark
        small = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(40)])
        order = [k for k in kinds() if k != "other"]
        assert order == ["counters", "insert"], scripts
        scripts.clear()
        large = store.put_cells([(uuid.uuid4(), "BASE", 1, {"blob": uuid.uuid4().hex * 8}) for _ in range(400)])
        order = [k for k in kinds() if k != "other"]
        assert order[-1] == "counters" and order.count("insert") > 1, scripts
        answer = store.changed_counts(mark)
        assert not answer.complete and answer.counts == {s: n for s, n in store.cell_counts().items() if n}
        _assert_dense_and_ordered(store, [*small, *large])


def test_concurrent_batches_over_shared_shards_get_dense_ids_in_order(mysql_database: str) -> None:
    """Eight writers, batches of 40 cells over 16 shards (several cells a shard: counters moved by different
    amounts in one statement), some rows repeated so that the duplicate path runs too."""
    with logstore.open(mysql_database, shards=16) as store:
        written: list[logstore.Cell] = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        shared = [uuid.uuid4() for _ in range(10)]

        def writer(n: int) -> None:
            try:
                for i in range(25):
                    batch = [(uuid.uuid4(), "BASE", 1, {"w": n, "i": i, "j": j}) for j in range(40)]
                    if i % 5 == 0:  # the same cells from every writer: stored once, returned to each
                        batch += [(k, "BASE", 1, {"shared": True}) for k in shared]
                    cells = store.put_cells(batch)
                    with lock:
                        written.extend(cells)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sum(store.cell_counts().values()) == 8 * 25 * 40 + len(shared)
        _assert_dense_and_ordered(store, written)


def test_a_server_killed_during_batches_never_hands_out_an_id_again(tmp_path: Path) -> None:
    """The counters move in the cells' transaction: a SIGKILL of the server loses the batches not committed,
    counters and cells together, and after the restart every shard's ids go on from its last stored cell."""
    with PrivateMariaDB(tmp_path / "db") as db:
        url = db.url("cells")
        store = logstore.open(url, shards=64, retry={"deadline": 20.0, "initial": 0.05, "maximum": 0.5})
        try:
            acked: list[logstore.Cell] = []
            stop = threading.Event()
            lock = threading.Lock()

            def writer(n: int) -> None:
                i = 0
                while not stop.is_set():
                    try:
                        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"w": n, "i": i}) for _ in range(30)])
                    except logstore.StorageError:  # not acknowledged: the server went away under it
                        continue
                    finally:
                        i += 1
                    with lock:
                        acked.extend(cells)

            threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
            for t in threads:
                t.start()
            while len(acked) < 3000:
                threading.Event().wait(0.05)
            db.kill()  # batches under way: their counters and cells were never committed
            db.start()
            before = len(acked)
            while len(acked) < before + 3000:
                threading.Event().wait(0.05)
            stop.set()
            for t in threads:
                t.join()
            _assert_dense_and_ordered(store, acked)
        finally:
            store.close()
