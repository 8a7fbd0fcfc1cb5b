"""A storage node with a replica (real MariaDB replication, tests/harness/servers.py): identical added_ids on
the replica, reads that fall back to it while the primary is unreachable (through a TCP proxy that cuts
every connection), possibly stale but never with a gap, and back to the primary when it returns."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pymysql
import pytest

import logstore
from logstore.backends.mysql.recorder import MySQLRecorder
from logstore.retry import RetryPolicy
from tests.harness.faults import TcpProxy
from tests.harness.shared_servers import MYSQL_REPLICA, mysql_admin

SHARDS = 4
QUICK = RetryPolicy(initial=0.05, maximum=0.2, deadline=1.5)


def caught_up(primary_url: str, replica_url: str, timeout: float = 30.0) -> None:
    """Wait until the replica applied everything the primary has logged."""
    primary, replica = mysql_admin(), mysql_admin(MYSQL_REPLICA)
    try:
        with primary.cursor() as cur:
            cur.execute("SELECT @@gtid_binlog_pos")
            position = cur.fetchone()[0]
        with replica.cursor() as cur:
            cur.execute("SELECT MASTER_GTID_WAIT(%s, %s)", (position, timeout))
            assert cur.fetchone()[0] == 0, f"the replica did not reach {position} in {timeout}s"
    finally:
        primary.close()
        replica.close()


def rows(url: str, shard: int) -> list[tuple[object, ...]]:
    parts = urlsplit(url)
    conn = pymysql.connect(host=parts.hostname, port=parts.port, user=parts.username, password=parts.password,
                           database=parts.path.lstrip("/"))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT added_id, row_key, column_name, ref_key, body, created_at FROM cells "
                        "WHERE shard = %s ORDER BY added_id", (shard,))
            return list(cur.fetchall())
    finally:
        conn.close()


@pytest.fixture
def proxied(replicated_database: tuple[str, str], tmp_path: Path) -> Iterator[tuple[Path, TcpProxy, str, str]]:
    """A cluster file whose one node's primary is reached through a TCP proxy, with the real replica."""
    primary, replica = replicated_database
    parts = urlsplit(primary)
    with TcpProxy(parts.hostname or "", parts.port or 3306) as proxy:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(f'shards = {SHARDS}\n[[nodes]]\nname = "a"\nshards = "0-{SHARDS - 1}"\n'
                           f'url = "{primary.replace(f":{parts.port}/", f":{proxy.port}/")}"\n'
                           f'replicas = ["{replica}"]\n')
        yield cluster, proxy, primary, replica


def test_the_replica_holds_the_same_cells_with_the_same_added_ids(replicated_database: tuple[str, str]) -> None:
    primary, replica = replicated_database
    with logstore.open(primary, shards=SHARDS) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", r, {"n": n}) for n in range(60) for r in (1, 2)][:100])
    caught_up(primary, replica)
    for shard in {c.shard for c in cells}:
        assert rows(replica, shard) == rows(primary, shard) != []


def test_reads_fall_back_to_the_replica_while_the_primary_is_unreachable(
        proxied: tuple[Path, TcpProxy, str, str]) -> None:
    cluster, proxy, primary, replica = proxied
    with logstore.open(cluster, retry=QUICK, connect_timeout=1.0, read_timeout=2.0) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(40)])
        store.claim_offsets("app.reader", "w1")
        store.commit_offsets("app.reader", "w1", {0: (3, {"by": "w1"})})
        caught_up(primary, replica)
        before = {s: store.get_cells_for_shard(s, 0, 1000)[0] for s in range(SHARDS)}
        recorder = store._recorders["a"]
        assert isinstance(recorder, MySQLRecorder) and recorder.fallback.replica_reads == 0
        mark = store.changed_counts().mark  # the primary's

        proxy.cut()
        # A replica applies rows later than the primary touched them: its counts are every shard's.
        fallen = store.changed_counts(mark)
        assert fallen.complete and fallen.counts == {s: len(before[s]) for s in range(SHARDS)}
        cell = cells[7]
        assert store.get_cell(cell.row_key, "BASE", 1) == cell
        assert store.get_cell_latest(cell.row_key, "BASE") == cell
        assert store.get_row(cell.row_key) == {"BASE": cell}
        assert {s: store.get_cells_for_shard(s, 0, 1000)[0] for s in range(SHARDS)} == before
        assert store.get_cells_for_shards({s: 0 for s in range(SHARDS)}, 1000) == before
        assert store.get_cells_for_shards({s: 0 for s in range(SHARDS)}, 1000, columns=["BASE"]) == before
        assert store.head(cell.shard) == before[cell.shard][-1].added_id
        assert store.read_offsets("app.reader")[0].location == 3
        assert recorder.fallback.replica_reads >= 8
        started = time.monotonic()
        with pytest.raises(logstore.StorageUnavailableError) as caught:  # writes need the primary
            store.put_cell(uuid.uuid4(), "BASE", 1, {"during": "outage"})
        assert caught.value.retriable and time.monotonic() - started < 10

        proxy.restore()
        time.sleep(recorder.fallback.hold + 0.1)  # the primary is tried again after the hold
        later = store.put_cell(uuid.uuid4(), "BASE", 1, {"after": "outage"})
        reads = recorder.fallback.replica_reads
        assert store.get_cell_latest(later.row_key, "BASE") == later  # from the primary: the replica may lag
        assert recorder.fallback.replica_reads == reads


def test_a_lagging_replica_serves_a_shorter_log_never_one_with_a_gap(
        proxied: tuple[Path, TcpProxy, str, str]) -> None:
    cluster, proxy, primary, replica = proxied
    admin = mysql_admin(MYSQL_REPLICA)
    try:
        with logstore.open(cluster, retry=QUICK, connect_timeout=1.0, read_timeout=2.0) as store:
            store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(30)])
            caught_up(primary, replica)
            with admin.cursor() as cur:
                cur.execute("STOP SLAVE SQL_THREAD")  # the replica falls behind from here
            try:
                store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(30, 60)])
                full = {s: store.get_cells_for_shard(s, 0, 1000)[0] for s in range(SHARDS)}
                proxy.cut()
                stale = {s: store.get_cells_for_shard(s, 0, 1000)[0] for s in range(SHARDS)}
            finally:
                with admin.cursor() as cur:
                    cur.execute("START SLAVE SQL_THREAD")
            for shard in range(SHARDS):
                assert stale[shard] == full[shard][:len(stale[shard])]  # a prefix: nothing skipped
            assert sum(map(len, stale.values())) == 30 < sum(map(len, full.values())) == 60
            caught_up(primary, replica)
            assert {s: store.get_cells_for_shard(s, 0, 1000)[0] for s in range(SHARDS)} == full
    finally:
        admin.close()


def test_a_replica_must_be_a_mysql_url(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('shards = 2\n[[nodes]]\nname = "a"\nshards = "0-1"\nurl = "sqlite:///x"\n'
                       'replicas = ["sqlite:///y"]\n')
    with pytest.raises(logstore.ConfigurationError, match="replica is a mysql:// URL"):
        logstore.open(cluster)
