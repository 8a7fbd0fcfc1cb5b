"""A private MariaDB primary and its replica, for tests that lose a primary (the shared pair on 3306/3307 must
never be stopped):

    with ReplicaPair(tmp_path / "pair", delay=2) as pair:   # logstore node URL: pair.primary.url("cells")
        pair.cut()                                           # the replica stops receiving (cells only the
        pair.primary.kill()                                  # primary has); SIGKILL: those are gone

Both servers write binary logs with GTIDs; the replica is ``--read-only`` and replicates every database of
the primary, ``delay`` seconds after it received them (``MASTER_DELAY``): a replica that is behind. (Stopping
its applier by hand is no way to make one: in GTID mode MariaDB discards the relay log when an applier starts
again with the receiver stopped.)
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pymysql

from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.services import HOST


def sql(port: int, *statements: str) -> list[dict[str, Any]]:
    """Run ``statements`` as cellstream on the private server at ``port``; the last one's rows."""
    conn = pymysql.connect(host=HOST, port=port, user="cellstream", password="cellstream", autocommit=True,
                           connect_timeout=5, cursorclass=pymysql.cursors.DictCursor)
    try:
        rows: list[dict[str, Any]] = []
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
                rows = list(cur.fetchall())
        return rows
    finally:
        conn.close()


def _reached(position: str, target: str) -> bool:
    """Whether GTID ``position`` (domain-server-sequence, comma-separated by domain) is at or past ``target``."""
    def seqs(pos: str) -> dict[str, int]:
        return {part.split("-")[0]: int(part.split("-")[2]) for part in pos.split(",") if part.strip()}
    have = seqs(position)
    return all(have.get(domain, -1) >= seq for domain, seq in seqs(target).items())


class ReplicaPair:
    """A primary and a replica of it, each a :class:`PrivateMariaDB` under ``workdir``."""

    def __init__(self, workdir: Path, *, delay: int = 0) -> None:
        """Args:
            workdir: where both servers keep their data.
            delay: the replica's ``MASTER_DELAY`` in seconds (0: none).
        """
        self.primary = PrivateMariaDB(workdir / "primary", options=["--server-id=1", "--log-bin=binlog",
                                                                     "--binlog-format=ROW"])
        self.replica = PrivateMariaDB(workdir / "replica", options=["--server-id=2", "--log-bin=binlog",
                                                                     "--binlog-format=ROW", "--read-only=1",
                                                                     "--relay-log=relay-bin"])
        self.delay = delay

    def start(self) -> None:
        """Start both and have the replica replicate (once: it resumes by itself after a restart)."""
        self.primary.start()
        self.replica.start()
        sql(self.primary.port, "CREATE USER IF NOT EXISTS 'repl'@'%' IDENTIFIED BY 'repl'",
            "GRANT REPLICATION SLAVE ON *.* TO 'repl'@'%'")
        if not sql(self.replica.port, "SHOW SLAVE STATUS"):
            sql(self.replica.port, f"CHANGE MASTER TO MASTER_HOST='{HOST}', MASTER_PORT={self.primary.port}, "
                                   f"MASTER_USER='repl', MASTER_PASSWORD='repl', MASTER_USE_GTID=slave_pos, "
                                   f"MASTER_DELAY={self.delay}, MASTER_CONNECT_RETRY=1", "START SLAVE")
        self.wait_running()

    def status(self) -> dict[str, Any]:
        """The replica's ``SHOW SLAVE STATUS`` row."""
        [row] = sql(self.replica.port, "SHOW SLAVE STATUS")
        return row

    def wait_running(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status["Slave_IO_Running"] == "Yes" and status["Slave_SQL_Running"] == "Yes":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replication did not start: {status.get('Last_IO_Error')} "
                                   f"{status.get('Last_SQL_Error')}")
            time.sleep(0.2)

    def wait_caught_up(self, timeout: float = 60.0) -> None:
        """Until the replica has applied everything the primary had committed when this was called."""
        [primary] = sql(self.primary.port, "SELECT @@gtid_binlog_pos AS pos")
        deadline = time.monotonic() + timeout
        while True:
            [replica] = sql(self.replica.port, "SELECT @@gtid_slave_pos AS pos")
            if _reached(replica["pos"], primary["pos"]):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica is still behind: {replica['pos']} against {primary['pos']}")
            time.sleep(0.1)

    def wait_received(self, timeout: float = 60.0) -> None:
        """Until the replica has received (not necessarily applied) everything the primary had committed when
        this was called."""
        [primary] = sql(self.primary.port, "SELECT @@gtid_binlog_pos AS pos")
        deadline = time.monotonic() + timeout
        while True:
            received = self.status()["Gtid_IO_Pos"]
            if _reached(received, primary["pos"]):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica has not received {primary['pos']}: at {received}")
            time.sleep(0.1)

    def cut(self) -> None:
        """Stop receiving (the applier goes on): what the primary commits from now on never reaches the replica."""
        sql(self.replica.port, "STOP SLAVE IO_THREAD")

    def stop(self) -> None:
        self.replica.stop()
        self.primary.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
