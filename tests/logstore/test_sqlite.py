from __future__ import annotations

import sqlite3
import threading
import uuid
from pathlib import Path

import msgpack
import pytest

import logstore
from logstore.backends.sqlite.recorder import DB_FILE
from tests.contracts.logstore_contract import OLD_OFFSETS, StoreContract, check_old_offsets_move
from tests.harness.stores import sqlite_file


class TestSQLiteStore(StoreContract):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    def corrupt_body(self, url: str, cell: logstore.Cell) -> None:
        with sqlite3.connect(sqlite_file(url)) as conn:
            conn.execute("UPDATE cells SET body = x'7f00' WHERE added_id = ?", (cell.added_id,))

    def shard_storage(self, url: str) -> set[int]:
        with sqlite3.connect(sqlite_file(url)) as conn:
            return {s for (s,) in conn.execute("SELECT DISTINCT shard FROM cells")}


def test_a_file_that_is_not_a_database_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / DB_FILE).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(logstore.ConfigurationError, match="not a database"):
        logstore.open(f"sqlite:///{tmp_path / 'bad'}")


def test_threads_that_exit_release_their_connections(sqlite_url: str) -> None:
    import gc
    import threading

    with logstore.open(sqlite_url, shards=2) as store:
        recorder = next(iter(store._recorders.values()))
        for _ in range(40):
            t = threading.Thread(target=store.head, args=(0,))
            t.start()
            t.join()
        gc.collect()
        assert len(recorder._db._all) <= 2


def test_sqlite_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with logstore.open("sqlite:///rel/dir", shards=2):
        pass
    assert (tmp_path / "rel" / "dir" / DB_FILE).exists()
    with logstore.open(f"sqlite:///{tmp_path}/abs", shards=2):
        pass
    assert (tmp_path / "abs" / DB_FILE).exists()
    with pytest.raises(logstore.InvalidArgumentError, match="needs a directory"):
        logstore.open("sqlite:///")
    with pytest.raises(logstore.InvalidArgumentError, match="unsupported store URL scheme 'redis'"):
        logstore.open("redis://localhost")


def test_offsets_of_the_table_a_row_per_shard_move_to_a_row_per_consumer(sqlite_url: str) -> None:
    def write_old() -> None:
        with sqlite3.connect(sqlite_file(sqlite_url)) as conn:
            conn.execute("CREATE TABLE cellstream_offsets (consumer TEXT NOT NULL, shard INTEGER NOT NULL, owner TEXT"
                         " NOT NULL, location INTEGER, doc TEXT NOT NULL DEFAULT '{}', commits INTEGER NOT NULL"
                         " DEFAULT 0, PRIMARY KEY (consumer, shard))")
            conn.executemany("INSERT INTO cellstream_offsets (consumer, shard, owner, location, doc)"
                             " VALUES (?, ?, ?, ?, ?)", OLD_OFFSETS)

    def old_table_exists() -> bool:
        with sqlite3.connect(sqlite_file(sqlite_url)) as conn:
            return bool(conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'cellstream_offsets'").fetchall())

    check_old_offsets_move(sqlite_url, write_old, old_table_exists)


def test_offset_docs_are_stored_as_ascii(sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=2) as store:
        store.claim_offsets("billing", "worker-a")
        store.commit_offsets("billing", "worker-a", {0: (1, {"note": "100% \u2713 caf\u00e9"})})
        with sqlite3.connect(sqlite_file(sqlite_url)) as conn:
            [(stored,)] = conn.execute("SELECT offsets FROM cellstream_consumers").fetchall()
        docs = msgpack.unpackb(stored)[2]
        assert all(doc.isascii() for doc in docs) and len(docs) == 2, docs  # any column charset holds them
        assert store.read_offsets("billing")[0].doc == {"note": "100% \u2713 caf\u00e9"}


def test_partial_counts_miss_no_shard_while_writers_commit(sqlite_url: str) -> None:
    """SQLite's partial counts are exact: a reader that applies each answer to the counts it holds ends with
    every shard's count, whatever the writers committed between and during its reads."""
    with logstore.open(sqlite_url, shards=256) as store:
        answer = store.changed_counts()
        held = dict(answer.counts)

        def write(n: int) -> None:
            for i in range(150):
                store.put_cells([(uuid.uuid4(), "BASE", 1, {"w": n, "i": i, "j": j}) for j in range(1 + i % 3)])

        writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
        for t in writers:
            t.start()
        partial, finished = 0, False
        while not finished:
            finished = not any(t.is_alive() for t in writers)  # then this answer is the last one needed
            answer = store.changed_counts(answer.mark)
            partial += not answer.complete
            held.update(answer.counts)
        for t in writers:
            t.join()
        assert partial > 10
        assert held == store.changed_counts().counts and sum(held.values()) == 4 * (50 * (1 + 2 + 3))
