"""The contract on real MariaDB, plus what only MySQL has: shard tables, pools, packets, errors."""

from __future__ import annotations

import ssl
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymysql
import pytest
from pymysql.constants import SERVER_STATUS

import logstore
from logstore.backends.mysql import recorder as mysql_recorder
from logstore.backends.mysql.recorder import TOUCH_MARGIN
from logstore.backends.mysql.target import MySQLTarget
from logstore.config import parse_node_url
from tests.contracts.logstore_contract import (
    OLD_OFFSETS,
    StoreContract,
    assert_no_skip,
    check_old_offsets_move,
    store_recorders,
)
from tests.harness.shared_servers import mysql_admin
from tests.harness.stores import keys_in_shard, two_nodes


def _connect(url: str) -> pymysql.connections.Connection:
    t = parse_node_url(url)
    assert isinstance(t, MySQLTarget)
    return pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password, database=t.database,
                           autocommit=True)


class TestMySQLStore(StoreContract):
    @pytest.fixture
    def url(self, mysql_database: str) -> str:
        return mysql_database

    def corrupt_body(self, url: str, cell: logstore.Cell) -> None:
        with _connect(url) as conn, conn.cursor() as cur:
            cur.execute("UPDATE cells SET body = x'7f00' WHERE shard = %s AND added_id = %s",
                        (cell.shard, cell.added_id))

    def shard_storage(self, url: str) -> set[int]:
        with _connect(url) as conn, conn.cursor() as cur:
            cur.execute("SELECT DISTINCT shard FROM cells")
            return {int(shard) for (shard,) in cur.fetchall()}


@pytest.mark.parametrize("heads", ["named", "range", "cut-short"])
def test_a_column_read_of_many_shards_crosses_ids_that_were_never_written(
    mysql_database: str, heads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids a shard skipped (a promotion burns some; a reader's floors may be seconds old) hold no cell: a read
    of some columns from before the hole finds the cells after it, whatever its ranges of ids held."""
    if heads == "range":  # the heads of a read of thousands of shards: a range of the node's shard rows
        monkeypatch.setattr(mysql_recorder, "_HEADS_NAMED", 0)
    elif heads == "cut-short":  # lists longer than group_concat_max_len: no head is known

        def cut(shards: str | None, last: str | None) -> dict[int, int]:
            raise ValueError("zip() argument 2 is shorter than argument 1")
        monkeypatch.setattr(mysql_recorder, "concat_counts", cut)
    with logstore.open(mysql_database, shards=4) as store:
        keys = {shard: keys_in_shard(store, shard, 1)[0] for shard in (0, 1, 2)}
        for key in keys.values():
            store.put_cell(key, "BASE", 1, {"before": True})
        with _connect(mysql_database) as conn, conn.cursor() as cur:  # burnt ids, no floor recorded
            cur.execute("UPDATE cellstream_shards SET last_id = last_id + 100 WHERE shard IN (0, 1)")
        after = {shard: store.put_cell(keys[shard], "BASE", 2, {"after": True}) for shard in (0, 1)}
        assert all(cell.added_id == 102 for cell in after.values())
        pages = store.get_cells_for_shards({0: 1, 1: 0, 2: 1}, 10, columns=["BASE"])
        assert [c.ref_key for c in pages[0]] == [2] and [c.ref_key for c in pages[1]] == [1, 2]
        assert pages[2] == []


def test_naive_auto_increment_tailing_does_skip(mysql_database: str) -> None:
    """The hazard the store's write path exists for, shown on a plain AUTO_INCREMENT table.

    This proves the no-skip harness can see a skip: with commits out of id order,
    a reader polling ``id > last`` loses a row for good.
    """
    logstore.open(mysql_database, shards=1).close()
    slow, fast, reader = _connect(mysql_database), _connect(mysql_database), _connect(mysql_database)
    with slow.cursor() as a, fast.cursor() as b, reader.cursor() as r:
        a.execute("CREATE TABLE naive (id BIGINT AUTO_INCREMENT PRIMARY KEY, v INT) ENGINE=InnoDB")
        a.execute("START TRANSACTION")
        a.execute("INSERT INTO naive (v) VALUES (1)")  # gets id 1, not committed yet
        b.execute("INSERT INTO naive (v) VALUES (2)")  # gets id 2, autocommits first
        r.execute("SELECT id FROM naive WHERE id > 0 ORDER BY id")
        seen = [i for (i,) in r.fetchall()]
        a.execute("COMMIT")
        r.execute("SELECT id FROM naive WHERE id > %s ORDER BY id", (seen[-1],))
        seen += [i for (i,) in r.fetchall()]
        r.execute("SELECT id FROM naive ORDER BY id")
        everything = [i for (i,) in r.fetchall()]
    assert everything == [1, 2]
    assert seen == [2], "the naive reader lost id 1"


def test_no_skip_across_two_databases_and_many_shards(mysql_database_factory: Callable[[], str],
                                                     tmp_path: Path) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = two_nodes(tmp_path / "cluster.toml", [a, b], 6)
    with logstore.open(cluster) as store:
        assert_no_skip(store, store_recorders(store), writers=10, per_writer=12)


def test_cluster_file_spreads_shards_over_two_databases(mysql_database_factory: Callable[[], str],
                                                        tmp_path: Path) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = two_nodes(tmp_path / "cluster.toml", [a, b], 64)
    with logstore.open(cluster) as store:
        assert store.nodes == ["a", "b"] and store.shard_count == 64
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(200)])
        assert {store.node_of(c.shard) for c in cells} == {"a", "b"}
        assert store.cell_counts() == {s: sum(1 for c in cells if c.shard == s) for s in range(64)}
        assert "secret" not in repr(store) and "***" in repr(store)
    for url, shards in ((a, range(0, 32)), (b, range(32, 64))):
        with _connect(url) as conn, conn.cursor() as cur:
            cur.execute("SELECT COUNT(*), MIN(shard), MAX(shard) FROM cells")
            total, low, high = cur.fetchone()
            assert total == sum(1 for c in cells if c.shard in shards) and low >= shards[0] and high <= shards[-1]
    with logstore.open(cluster) as store:
        assert [store.get_cell(c.row_key, "BASE", 1) for c in cells] == cells
    # the same database given other shards than it was created with
    cluster.write_text(f'shards = 64\n[[nodes]]\nname = "a"\nurl = "{a}"\nshards = "0-15"\n'
                       f'[[nodes]]\nname = "b"\nurl = "{b}"\nshards = "16-63"\n')
    with pytest.raises(logstore.ConfigurationError, match="holds shards 0-31"):
        logstore.open(cluster)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('shards = 8\n[[nodes]]\nname = "a"\nurl = "mysql://u@h/d"\nshards = "0-6"\n', "expected 7"),
        ('shards = 8\n[[nodes]]\nname = "a"\nurl = "mysql://u@h/d"\nshards = "1-7"\n', "expected 0"),
        ('shards = 8\n[[nodes]]\nname = "a"\nurl = "mysql://u@h/d"\nshards = "0-4"\n'
         '[[nodes]]\nname = "b"\nurl = "mysql://u@h/e"\nshards = "4-7"\n', "gaps or overlaps"),
        ('shards = 8\n[[nodes]]\nname = "a"\nurl = "ftp://x"\nshards = "0-7"\n', "nodes.0.url"),
        ('shards = 8\n[[nodes]]\nname = "a"\nurl = "mysql://u@h/d"\nshards = "seven"\n', "first-last"),
        ("shards = [", "not valid TOML"),
    ],
)
def test_bad_cluster_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(logstore.ConfigFileError, match=message) as raised:
        logstore.open(path)
    assert raised.value.source == f"cluster file {path}"
    with pytest.raises(logstore.ConfigFileError, match=r"missing\.toml: cannot read it"):
        logstore.open(tmp_path / "missing.toml")


def test_batches_larger_than_one_packet_stay_atomic(mysql_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import logstore.backends.mysql.recorder as backend

    sizes: list[int] = []
    original = backend.run_script

    def spy(cur: Any, statements: Any) -> Any:
        sizes.append(len(cur.mogrify(";\n".join(s for s, _ in statements), [a for _, p in statements for a in p])))
        return original(cur, statements)

    monkeypatch.setattr(backend, "run_script", spy)
    with logstore.open(mysql_database, shards=2, max_statement_bytes=64 * 1024) as store:
        items: list[Any] = [(uuid.uuid4(), "BASE", 1, {"blob": uuid.uuid4().hex * 40, "i": i}) for i in range(600)]
        cells = store.put_cells(items)
        assert [c.body["i"] for c in cells] == list(range(600))
        assert all(store.get_cell(c.row_key, "BASE", 1) == c for c in cells[::37])
        fresh = [(uuid.uuid4(), "BASE", 1, {"blob": uuid.uuid4().hex * 40}) for _ in range(600)]
        with pytest.raises(logstore.CellConflictError):
            store.put_cells([*fresh, (items[-1][0], "BASE", 1, {"changed": True})])
        assert sum(s.cells for s in store.shard_stats()) == 600
        assert store.get_cell(fresh[0][0], "BASE", 1) is None
        # retrying the whole batch goes through the duplicate path, which must split too
        sizes.clear()
        assert store.put_cells(items + fresh[:100])[:600] == cells
        assert len(sizes) > 3 and max(sizes) <= 64 * 1024, sizes


def test_changed_counts_reads_the_shards_written_since_the_mark_on_each_node(
        mysql_database_factory: Callable[[], str], tmp_path: Path) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = two_nodes(tmp_path / "cluster.toml", [a, b], 64)
    with logstore.open(cluster) as store:
        time.sleep(TOUCH_MARGIN + 0.1)  # the rows created with the nodes are older than a look's margin
        first = store.changed_counts()
        assert first.complete and first.counts == dict.fromkeys(range(64), 0)
        quiet = store.changed_counts(first.mark)
        assert not quiet.complete and quiet.counts == {}
        store.put_cells([(k, "BASE", 1, {}) for k in keys_in_shard(store, 5, 2) + keys_in_shard(store, 40, 1)])
        moved = store.changed_counts(quiet.mark)
        assert not moved.complete and moved.counts == {5: 2, 40: 1}  # one shard on each node
        assert store.changed_counts(object()).counts == {**first.counts, 5: 2, 40: 1}  # not a mark: every shard


def test_a_node_created_before_the_touched_column_gets_it_at_open(mysql_database: str) -> None:
    with logstore.open(mysql_database, shards=4) as store:
        store.put_cell(uuid.uuid4(), "BASE", 1, {"n": 1})
    with _connect(mysql_database) as conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE cellstream_shards DROP INDEX shards_touched, DROP COLUMN touched")
    with logstore.open(mysql_database, shards=4) as store:
        time.sleep(TOUCH_MARGIN + 0.1)
        mark = store.changed_counts().mark
        cell = store.put_cell(uuid.uuid4(), "BASE", 1, {"n": 2})
        answer = store.changed_counts(mark)
        assert not answer.complete and answer.counts == {cell.shard: cell.added_id}


def test_a_failure_before_commit_writes_nothing_and_holds_no_lock(mysql_database: str) -> None:
    with logstore.open(mysql_database, shards=2, pool_size=1) as store:
        [recorder] = store_recorders(store)

        def fail(shards: Any) -> None:
            raise logstore.StorageError("injected failure before COMMIT")

        key = uuid.uuid4()
        recorder.before_commit = fail
        with pytest.raises(logstore.StorageError, match="injected"):
            store.put_cell(key, "BASE", 1, {"v": 1})
        recorder.before_commit = None
        assert all(not c.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS for c in recorder._pool._idle)
        other = store.put_cell(uuid.uuid4(), "BASE", 1, {"v": 2})
        assert store.get_cell(key, "BASE", 1) is None
        assert store.get_cell(other.row_key, "BASE", 1) == other
        admin = mysql_admin()
        with admin.cursor() as cur:
            # Only the store's connections: other tests may run beside this one on the same server.
            threads = [c.thread_id() for c in recorder._pool._idle] or [0]
            cur.execute("SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_mysql_thread_id IN ("
                        + ", ".join(map(str, threads)) + ")")
            assert cur.fetchone()[0] == 0
        # and a connection given back inside a transaction is never reused
        with recorder._pool.connection() as conn, conn.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute("SELECT 1")
        assert conn not in recorder._pool._idle and not conn.open


def test_killed_connection_is_retried_transparently(mysql_database: str) -> None:
    with logstore.open(mysql_database, shards=4, pool_size=1) as store:
        key = uuid.uuid4()
        store.put_cell(key, "BASE", 1, {"v": 1})
        recorder = store_recorders(store)[0]
        [conn] = recorder._pool._idle
        admin = mysql_admin()
        with admin.cursor() as cur:
            cur.execute(f"KILL CONNECTION {conn.thread_id()}")
        admin.close()
        assert store.get_cell_latest(key, "BASE").body == {"v": 1}
        cell = store.put_cell(key, "BASE", 2, {"v": 2})
        assert store.get_cell(key, "BASE", 2) == cell


def test_unreachable_server_is_retriable_and_bad_password_is_configuration(mysql_database: str) -> None:
    t = parse_node_url(mysql_database)
    assert isinstance(t, MySQLTarget)
    started = time.monotonic()
    with pytest.raises(logstore.StorageUnavailableError) as info:
        logstore.open(f"mysql://{t.user}:{t.password}@127.0.0.1:1/{t.database}",
                      retry={"deadline": 0.5, "initial": 0.05}, connect_timeout=1)
    assert info.value.retriable and time.monotonic() - started < 10
    with pytest.raises(logstore.ConfigurationError, match="cannot be encoded"):
        logstore.open(f"mysql://{t.user}:p%E2%82%AC@{t.host}:{t.port}/{t.database}")
    with pytest.raises(logstore.InvalidArgumentError, match="cannot be parsed"):
        logstore.open("mysql://u:p@[::1/db")
    with pytest.raises(logstore.ConfigurationError, match="Access denied") as denied:
        logstore.open(f"mysql://{t.user}:wrong-Secret-77@{t.host}:{t.port}/{t.database}")
    assert "wrong-Secret-77" not in str(denied.value)
    assert not denied.value.retriable


def test_writers_to_one_shard_queue_but_never_deadlock(mysql_database: str) -> None:
    with logstore.open(mysql_database, shards=3) as store:
        errors: list[BaseException] = []

        def writer(n: int) -> None:
            try:
                for i in range(20):
                    store.put_cells([(uuid.uuid4(), "BASE", n * 100 + i, {"n": n}) for _ in range(6)])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sum(s.cells for s in store.shard_stats()) == 8 * 20 * 6


class TestMySQLStoreAt4096Shards(TestMySQLStore):
    """The whole contract, the out-of-order-commit proof included, at the default shard count."""

    shards = 4096


def test_a_database_of_the_table_per_shard_layout_is_refused_and_left_as_it_was(mysql_database: str) -> None:
    with logstore.open(mysql_database, shards=16):
        pass
    with _connect(mysql_database) as conn, conn.cursor() as cur:
        # What layout 1 wrote: no layout entry in the metadata, and a table per shard.
        cur.execute("DELETE FROM cellstream_meta WHERE name = 'layout'")
        cur.execute("CREATE TABLE cells_0003 (added_id BIGINT AUTO_INCREMENT PRIMARY KEY) ENGINE=InnoDB")
    for attempt in (lambda: logstore.open(mysql_database), lambda: logstore.open(mysql_database, shards=16)):
        with pytest.raises(logstore.ConfigurationError, match=r"layout 1 \(a table per shard\).*reads layout 2"):
            attempt()
    with _connect(mysql_database) as conn, conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM cellstream_meta WHERE name = 'layout'")
        assert cur.fetchone()[0] == 0, "opening wrote into the refused node"


def test_a_batch_over_many_shards_is_one_insert_and_one_counter_statement(
        mysql_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-batch cost does not grow with the shards it touches: the statements of a write are counted."""
    import logstore.backends.mysql.recorder as backend

    statements: list[str] = []
    original = backend.run_script

    def spy(cur: Any, script: Any) -> Any:
        statements.extend(sql for sql, _ in script)
        return original(cur, script)

    monkeypatch.setattr(backend, "run_script", spy)
    with logstore.open(mysql_database) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(1000)])
        assert len({c.shard for c in cells}) > 800
        assert len(statements) == 5, statements  # START, counters (locked and moved), their values; INSERT, COMMIT
        by_shard: dict[int, list[int]] = {}
        for cell in cells:
            by_shard.setdefault(cell.shard, []).append(cell.added_id)
        assert all(ids == list(range(1, len(ids) + 1)) for ids in by_shard.values()), "ids are dense per shard"
        assert all(store.head(s) == len(ids) for s, ids in list(by_shard.items())[:50])


def test_preferred_tls_to_a_server_without_it_is_refused_once_and_loads_no_ca_store(
        mysql_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PREFERRED (the default without ssl_* parameters) against a server that offers no TLS, as the shared test
    server: the first connection's TLS attempt is refused, every later one goes in clear at once, and no
    connection loads the system's CAs (pymysql's own PREFERRED context loads them for each, about 20 ms)."""
    asked_tls: list[bool] = []
    loads: list[object] = []
    connect, load = pymysql.connect, ssl.SSLContext.load_default_certs

    def spy_connect(*args: Any, **kwargs: Any) -> Any:
        asked_tls.append("ssl" in kwargs)
        return connect(*args, **kwargs)

    def spy_load(context: ssl.SSLContext, *args: Any) -> None:
        loads.append(context)
        load(context, *args)

    database = mysql_database.rsplit("/", 1)[1]
    with mysql_admin() as admin, admin.cursor() as cur:  # connected before the spies, in no database
        monkeypatch.setattr(pymysql, "connect", spy_connect)
        monkeypatch.setattr(ssl.SSLContext, "load_default_certs", spy_load)
        with logstore.open(mysql_database, shards=4) as store:
            cell = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": 1})])[0]
            for _ in range(3):
                cur.execute("SELECT id FROM information_schema.processlist WHERE db = %s", (database,))
                for (thread,) in cur.fetchall():
                    cur.execute(f"KILL {int(thread)}")  # the store's next call needs a new connection
                assert store.get_cell(cell.row_key, "BASE", 1) == cell
    assert asked_tls[0] and asked_tls.count(True) == 1, asked_tls
    assert len(asked_tls) >= 5, asked_tls  # the refused attempt, the first connection and three reconnections
    assert loads == []


def test_times_parsed_from_a_page_are_remembered_within_a_bound(mysql_database: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A read remembers the time texts it parsed (a transaction's cells share one, and a page of many shards
    holds many transactions' cells): every cell still gets its own transaction's time, and what is remembered
    stays within its bound, however many transactions a tailer reads in its life."""
    from logstore.backends.mysql import recorder

    monkeypatch.setattr(recorder, "_TIMES_KEPT", 2)
    monkeypatch.setattr(recorder, "_times", {})
    with logstore.open(mysql_database, shards=4) as store:
        written = []
        for n in range(5):
            written += store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n, "i": i}) for i in range(6)])
            time.sleep(0.002)  # each transaction its own time
        assert len({cell.created_at for cell in written}) == 5
        read = [cell for cells in store.get_cells_for_shards(dict.fromkeys(range(4), 0), 100).values()
                for cell in cells]
    assert sorted(read, key=lambda c: (c.shard, c.added_id)) == sorted(written, key=lambda c: (c.shard, c.added_id))
    assert 1 <= len(recorder._times) <= 2


def test_offsets_of_the_table_a_row_per_shard_move_to_a_row_per_consumer(mysql_database: str) -> None:
    def write_old() -> None:
        with _connect(mysql_database) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE cellstream_offsets (consumer VARCHAR(200) CHARACTER SET utf8mb4 COLLATE"
                        " utf8mb4_bin NOT NULL, shard INT NOT NULL, owner VARCHAR(200) NOT NULL, location BIGINT NULL,"
                        " doc TEXT NOT NULL, commits BIGINT NOT NULL DEFAULT 0, PRIMARY KEY (consumer, shard))")
            cur.executemany("INSERT INTO cellstream_offsets (consumer, shard, owner, location, doc)"
                            " VALUES (%s, %s, %s, %s, %s)", OLD_OFFSETS)
            conn.commit()

    def old_table_exists() -> bool:
        with _connect(mysql_database) as conn, conn.cursor() as cur:
            cur.execute("SHOW TABLES LIKE 'cellstream_offsets'")
            return bool(cur.fetchall())

    check_old_offsets_move(mysql_database, write_old, old_table_exists)


def test_a_block_too_long_for_the_server_is_read_row_by_row(mysql_database: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """GROUP_CONCAT cuts a block at ``group_concat_max_len`` with only a warning: such a block is read again
    by rows, and comes out byte for byte as the server builds a whole one."""
    with logstore.open(mysql_database, shards=4) as store:
        keys = keys_in_shard(store, 0, 40) + keys_in_shard(store, 1, 3)
        store.put_cells([(k, "BASE", i, {"i": i, "pad": "p" * i}) for i, k in enumerate(keys)])
        ranges = {0: (0, 40), 1: (0, 3), 2: (0, 5)}
        whole = store.read_blocks(ranges)
        assert [whole[s].cells for s in (0, 1, 2)] == [40, 3, 0]
        monkeypatch.setattr(mysql_recorder, "_BLOCK_ROOM", len(whole[1].data) + 1)  # shard 0's block is longer
        cut = store.read_blocks(ranges)
    assert cut == whole
