"""A MySQL/MariaDB storage node's load as a job's throttle sees it (:mod:`logstore.jobs.load`): a heartbeat, as
pt-heartbeat's and gh-ost's.

Each probe writes this host's row of ``cellstream_heartbeat`` on the node's primary (the time of that write,
start to commit, is the node's write-latency sample), then reads the row on each replica. A replica's lag is
the age of the oldest heartbeat this probe wrote that the replica has not applied yet (0 when it has the
last one): a lower bound of its true lag, exact to the probe interval, measured with this process's clock
only, so clocks of servers or of hosts that disagree cannot make a healthy replica look late. (Reading
``now - heartbeat`` instead, as pt-heartbeat does, overstates the lag by up to a probe interval, and by hours
at the first probe after a pause.) The row is one per host probing: processes of one host share a clock.

When a replica's heartbeat cannot be read (its table not there yet, a privilege missing), its
``Seconds_Behind_Master`` answers instead; NULL there means it does not replicate (its SQL thread stopped):
an infinite lag.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import pymysql

from logstore.backends.mysql.errors import NO_TABLE, code, translate
from logstore.backends.mysql.pool import Connection
from logstore.backends.mysql.target import MySQLTarget
from logstore.jobs.load import NodeLoad, ReplicaLag

logger = logging.getLogger(__name__)
SCHEMA = ("CREATE TABLE IF NOT EXISTS cellstream_heartbeat ("
          " writer VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,"
          " ts DATETIME(6) NOT NULL) ENGINE=InnoDB")
_BEAT = "INSERT INTO cellstream_heartbeat (writer, ts) VALUES (%s, %s) ON DUPLICATE KEY UPDATE ts = VALUES(ts)"
_READ = "SELECT ts FROM cellstream_heartbeat WHERE writer = %s"
_REMEMBERED = 4096  # heartbeats kept (a half-hour at 2 a second): a replica without any of them lags beyond that
_UNREADABLE = {NO_TABLE, 1142, 1143}  # no table, or no SELECT on it or its column: ask the replica's status
_SYNTAX = 1064


def _where(target: MySQLTarget) -> str:
    return f"{target.host}:{target.port}"


class MySQLHeartbeat:
    """The probe of one MySQL/MariaDB node (:class:`logstore.jobs.load.NodeProbe`), on connections of its own.

    Not thread-safe: its guard probes a node from one thread at a time.

    Args:
        node: the node's name.
        primary: where the heartbeat is written.
        replicas: where it is read.
        connect: opens a connection to a target (autocommit, its waits bounded by ``timeout``).
        timeout: what ``connect`` bounds waits by: a write that fails after this long is a slow node, not a
            down one.
        writer: the row's key (None: this host's name).
    """

    def __init__(self, node: str, primary: MySQLTarget, replicas: Sequence[MySQLTarget],
                 connect: Callable[[MySQLTarget], Connection], *, timeout: float, writer: str | None = None) -> None:
        self.node = node
        self._primary = primary
        self._replicas = list(replicas)
        self._connect = connect
        self._timeout = timeout
        self._writer = (writer or socket.gethostname())[:255]
        self._conns: dict[MySQLTarget, Connection] = {}
        self._written: deque[tuple[dt.datetime, float]] = deque(maxlen=_REMEMBERED)  # (value, committed: monotonic)
        self._schema = False

    def _conn(self, target: MySQLTarget) -> Connection:
        conn = self._conns.get(target)
        if conn is None:
            conn = self._conns[target] = self._connect(target)
        return conn

    def _drop(self, target: MySQLTarget) -> None:
        conn = self._conns.pop(target, None)
        if conn is not None:
            with suppress(pymysql.Error, OSError):
                conn.close()

    def probe(self, replicas: bool) -> NodeLoad:
        connected = False
        started = time.monotonic()
        try:
            conn = self._conn(self._primary)
            connected = True
            with conn.cursor() as cur:
                if not self._schema:
                    cur.execute(SCHEMA)
                    self._schema = True
                value = dt.datetime.now(dt.UTC).replace(tzinfo=None)
                if self._written and value <= self._written[-1][0]:  # the clock went back: keep them increasing
                    value = self._written[-1][0] + dt.timedelta(microseconds=1)
                started = time.monotonic()
                cur.execute(_BEAT, (self._writer, value.isoformat(" ", "microseconds")))
                committed = time.monotonic()
        except (pymysql.Error, OSError) as exc:
            self._drop(self._primary)
            elapsed = time.monotonic() - started
            error = translate(exc, self.node) if isinstance(exc, pymysql.Error) else exc
            if connected and elapsed >= self._timeout * 0.9:
                # Connected, then no answer within the timeout: a node this slow is loaded, not gone.
                return NodeLoad(self.node, latency_ms=elapsed * 1000)
            if isinstance(exc, pymysql.Error) and not getattr(error, "retriable", False):
                return NodeLoad(self.node, error=str(error))  # the probe cannot work here; the node may be fine
            return NodeLoad(self.node, down=str(error))
        self._written.append((value, committed))
        lags = tuple(self._lag(target) for target in self._replicas) if replicas else ()
        return NodeLoad(self.node, latency_ms=(committed - started) * 1000, replicas=lags)

    def _behind(self, applied: dt.datetime | None) -> float:
        """Seconds since the oldest heartbeat written here that is newer than ``applied`` (what the replica has)
        was committed; 0 when there is none."""
        missing: float | None = None
        for value, committed in reversed(self._written):
            if applied is not None and value <= applied:
                break
            missing = committed
        return 0.0 if missing is None else max(0.0, time.monotonic() - missing)

    def _lag(self, target: MySQLTarget) -> ReplicaLag:
        where = _where(target)
        try:
            conn = self._conn(target)
            with conn.cursor() as cur:
                try:
                    cur.execute(_READ, (self._writer,))
                except pymysql.Error as exc:
                    if (code(exc) or 0) not in _UNREADABLE:
                        raise
                    return self._seconds_behind(cur, where, f"heartbeat unreadable: {exc.args[-1]}")
                row = cur.fetchone()
        except (pymysql.Error, OSError) as exc:
            self._drop(target)
            error = translate(exc, f"{self.node} replica {where}") if isinstance(exc, pymysql.Error) else exc
            return ReplicaLag(where, None, error=str(error))
        applied = None if row is None else row[0]
        if isinstance(applied, dt.datetime) and applied.tzinfo is not None:
            applied = applied.astimezone(dt.UTC).replace(tzinfo=None)
        return ReplicaLag(where, self._behind(applied))

    def _seconds_behind(self, cur: Any, where: str, why: str) -> ReplicaLag:
        """The replica's own idea of its lag (``SHOW REPLICA STATUS``, ``SHOW SLAVE STATUS`` before MariaDB
        10.5 and MySQL 8.0.22)."""
        try:
            cur.execute("SHOW REPLICA STATUS")
        except pymysql.Error as exc:
            if code(exc) != _SYNTAX:
                return ReplicaLag(where, None, "seconds_behind_master", f"{why}; replica status: {exc.args[-1]}")
            cur.execute("SHOW SLAVE STATUS")
        names = [d[0] for d in cur.description or ()]
        rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        if not rows:
            return ReplicaLag(where, None, "seconds_behind_master", f"{why}; and it is not a replica")
        behind = [r.get("Seconds_Behind_Master", r.get("Seconds_Behind_Source")) for r in rows]
        known = [int(b) for b in behind if b is not None]
        if len(known) < len(behind):
            return ReplicaLag(where, math.inf, "seconds_behind_master", "Seconds_Behind_Master is NULL: its "
                              "replication threads are stopped")
        return ReplicaLag(where, float(max(known)), "seconds_behind_master")

    def close(self) -> None:
        for target in list(self._conns):
            self._drop(target)
