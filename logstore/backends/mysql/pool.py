"""MySQL connections: the bounded pool of one server, multi-statement scripts in one round trip, and
reads that fall back from a storage node's primary to its replicas.

A storage node in the cluster file is a primary with optional replicas (MariaDB
replication). Writes go to the primary only. A read goes to the primary; when the
primary is unavailable it goes to the replicas in order, and its answer is possibly
stale: a replica applies the primary's transactions in commit order, with the same
added_ids, so a stale log page is a shorter one, never one with a gap. After a
failed primary, reads skip it for ``hold`` seconds before trying it again, so a
dead primary costs one connect timeout per hold period, not one per read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, NamedTuple, TypeVar

import pymysql
from pymysql.constants import SERVER_STATUS

from logstore.errors import LogstoreError, StorageError, StorageUnavailableError

logger = logging.getLogger(__name__)
T = TypeVar("T")
Connection = pymysql.connections.Connection
Statement = tuple[str, Sequence[Any]]


class Pool:
    """A bounded LIFO pool of autocommit connections.

    A connection comes back only when it is known clean: not after a driver error or
    an interruption (state unknown), and never while still inside a transaction.
    """

    def __init__(self, connect: Callable[[], Connection], size: int, timeout: float) -> None:
        self._connect = connect
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)
        self._timeout = timeout
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        if not self._slots.acquire(timeout=self._timeout):
            raise StorageUnavailableError("no free MySQL connection in the pool")
        try:
            with self._lock:
                if self._closed:
                    raise StorageError("the store is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect()
            try:
                yield conn
            except LogstoreError:
                self._release(conn)  # our own error (a conflict, say): reusable unless mid-transaction
                raise
            except BaseException:
                self.discard(conn)
                raise
            self._release(conn)
        finally:
            self._slots.release()

    def _release(self, conn: Connection) -> None:
        # Still inside a transaction (its COMMIT never ran), a connection would hold shard
        # locks and commit stale writes with its next START TRANSACTION: never reuse it.
        if not getattr(conn, "server_status", 0) & SERVER_STATUS.SERVER_STATUS_IN_TRANS:
            with self._lock:
                if not self._closed:
                    self._idle.append(conn)
                    return
        self.discard(conn)

    @staticmethod
    def discard(conn: Connection) -> None:
        with suppress(pymysql.Error, OSError):
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            self.discard(conn)




class Result(NamedTuple):
    rows: tuple[Any, ...] | None  # None for a statement without a result set
    insert_id: int  # from the OK packet: the first AUTO_INCREMENT id of an INSERT


def run_script(cur: pymysql.cursors.Cursor, statements: Sequence[Statement]) -> list[Result]:
    """Send ``statements`` in one round trip; return each one's result."""
    sql = ";\n".join(s for s, _ in statements)
    args = [a for _, params in statements for a in params]
    cur.execute(sql, args)
    results = [Result(cur.fetchall() if cur.description else None, cur.lastrowid)]
    while cur.nextset():
        results.append(Result(cur.fetchall() if cur.description else None, cur.lastrowid))
    return results


class ReadFallback:
    """The primary-then-replicas order of one storage node's reads (see the module docstring)."""

    def __init__(self, node: str, hold: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.hold = hold
        self._clock = clock
        self._skip_until = 0.0
        self.replica_reads = 0  # reads answered by a replica (tests and logs)

    def read(self, primary: Callable[[], T], replicas: Sequence[Callable[[], T]]) -> T:
        failed: StorageUnavailableError | None = None
        tried_primary = self._clock() >= self._skip_until
        if tried_primary:
            try:
                return primary()
            except StorageUnavailableError as exc:
                if self._skip_until == 0.0 or self._clock() >= self._skip_until:
                    logger.warning("storage node %s: primary unavailable (%s); reading from its replicas, "
                                   "possibly stale", self.node, exc)
                self._skip_until = self._clock() + self.hold
                failed = exc
        for i, replica in enumerate(replicas):
            try:
                result = replica()
            except StorageUnavailableError as exc:
                logger.warning("storage node %s: replica %d unavailable too: %s", self.node, i, exc)
                failed = failed or exc
                continue
            self.replica_reads += 1
            return result
        if not tried_primary:  # every replica failed while the primary was being skipped: it may be back
            return primary()
        assert failed is not None
        raise failed
