"""A replica made its node's primary, on the MySQL/MariaDB servers themselves (``cellstream nodes promote``,
:func:`logstore.nodes.promote_node` records it in the shard map): Vitess's EmergencyReparentShard for one node.

1. **Catch up.** The replica applies every transaction it received from the lost primary: what it received is
   all there is. Nothing is stopped before that: a replica with both threads stopped discards its relay log
   when one starts again in GTID mode, so a ``MASTER_DELAY`` is waited out (``--wait`` longer than it), and a
   replica whose applier was stopped by hand while its receiver ran is started. Its replication is then
   stopped and forgotten (``RESET SLAVE ALL``) and it is made writable.
2. **Burn ids.** The lost primary may have committed cells the replica never received and shown them to
   consumers (a tailer reads committed cells at once). Their ids must never name another cell, so each shard's
   next id is set above ``last_id + burn`` (``id_floor``): ids are skipped, never reused, and a consumer past
   ``last_id`` goes on from where it is (at least once, never a skip). ``burn`` bounds how far a replica may
   have been behind, in cells of one shard.
3. **Fence the former primary** when it answers (a planned switchover, or one that came back): every shard
   row refuses writes (``fence``, the mechanism of shard moves), and it is made read-only where the user may.
   One that does not answer is fenced in the shard map (no process opens it again), and fenced here by
   ``cellstream nodes list`` if it ever answers.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pymysql

from logstore.backends.mysql.errors import code
from logstore.backends.mysql.recorder import BURN_IDS, MySQLRecorder
from logstore.backends.mysql.target import MySQLTarget
from logstore.errors import PromotionError, StorageUnavailableError

logger = logging.getLogger(__name__)
BURN = 1_000_000  # ids skipped per shard: more cells of one shard than a replica is ever behind
_ACCESS_DENIED = (1045, 1227)  # ER_ACCESS_DENIED_ERROR, ER_SPECIFIC_ACCESS_DENIED_ERROR


def _status(cur: pymysql.cursors.Cursor) -> dict[str, Any] | None:
    cur.execute("SHOW SLAVE STATUS")
    row = cur.fetchone()
    if row is None:
        return None
    return dict(zip([d[0] for d in cur.description or ()], row, strict=True))


def _applied(status: dict[str, Any]) -> bool:
    """Whether the SQL thread has applied everything the IO thread received."""
    return (status["Relay_Master_Log_File"] == status["Master_Log_File"]
            and int(status["Exec_Master_Log_Pos"]) >= int(status["Read_Master_Log_Pos"]))


def make_primary(recorder: MySQLRecorder, replica: MySQLTarget, *, wait: float = 60.0, burn: int = BURN) -> int:
    """Make ``replica`` a primary: apply what it received, stop replicating, writable, ids burnt (steps 1-2 of
    the module docstring). Idempotent: a server already promoted only has its ids burnt again (a no-op when
    no write came since).

    Args:
        recorder: the node's recorder (its connections' settings).
        replica: the replica, with its password.
        wait: seconds to wait for the replica to apply what it received.
        burn: ids skipped per shard.

    Returns:
        The shards whose ids were burnt.

    Raises:
        PromotionError: its replication failed, or it did not catch up within ``wait``.
        StorageUnavailableError: it does not answer.
    """
    where = f"{replica.host}:{replica.port}"

    def catch_up(cur: pymysql.cursors.Cursor) -> None:
        status = _status(cur)
        if status is None:
            logger.info("%s replicates from nothing: promoted already, or never a replica", where)
            return
        if status["Slave_SQL_Running"] != "Yes":
            cur.execute("START SLAVE SQL_THREAD")
        deadline = time.monotonic() + wait
        while True:
            status = _status(cur)
            assert status is not None
            if int(status.get("Last_SQL_Errno") or 0):
                raise PromotionError(f"replica {where} cannot apply what it received: {status['Last_SQL_Error']}")
            if _applied(status):
                break
            if time.monotonic() > deadline:
                raise PromotionError(f"replica {where} has not applied what it received within {wait:g} s "
                                     f"(at {status['Exec_Master_Log_Pos']} of {status['Read_Master_Log_Pos']}"
                                     f" in {status['Master_Log_File']}): nothing was switched; try a longer --wait")
            time.sleep(0.1)
        cur.execute("STOP SLAVE")
        cur.execute("RESET SLAVE ALL")
        cur.execute("SET GLOBAL read_only = 0")

    recorder.on_server(replica, "promote replica", catch_up, timeout=max(wait, 10.0) + 10.0)

    def burn_ids(cur: pymysql.cursors.Cursor) -> int:
        return int(cur.execute(BURN_IDS, (burn, burn)))
    burnt = recorder.on_server(replica, "burn ids", burn_ids)
    logger.warning("replica %s of node %s is its primary now; %d shards' next ids skip %d ids", where,
                   recorder.name, burnt, burn)
    return burnt


def fence_former(recorder: MySQLRecorder, former: MySQLTarget, node: str) -> bool:
    """Refuse writes on a former primary of ``node`` that answers (step 3); False when it does not answer.

    Its shard rows are fenced towards ``node``, so a process that still writes there is told the shard moved,
    reads the map again and writes to the new primary.
    """
    def fence(cur: pymysql.cursors.Cursor) -> None:
        cur.execute("UPDATE cellstream_shards SET fence = %s WHERE fence IS NULL", (node,))
        try:
            cur.execute("SET GLOBAL read_only = 1")
        except pymysql.err.OperationalError as exc:
            if code(exc) not in _ACCESS_DENIED:
                raise
            logger.info("former primary %s:%d of node %s fenced; not made read-only (no privilege)",
                        former.host, former.port, node)
    try:
        recorder.on_server(former, "fence former primary", fence, timeout=2.0)
    except StorageUnavailableError:
        return False
    logger.warning("former primary %s:%d of node %s answered: its writes are refused", former.host, former.port,
                   node)
    return True
