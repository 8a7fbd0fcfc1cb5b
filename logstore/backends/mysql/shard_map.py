"""The shard map's versions as a MySQL storage node keeps them (:mod:`logstore.shard_map`): every node a copy."""

from __future__ import annotations

import pymysql

from logstore.backends.mysql.errors import NO_TABLE, code

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cellstream_map ("
    " version BIGINT NOT NULL PRIMARY KEY, doc LONGTEXT NOT NULL,"
    " written_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE=InnoDB"
)


def read_newest(cur: pymysql.cursors.Cursor) -> tuple[int, str] | None:
    """The newest version the node holds and its document; None when it holds none."""
    try:
        cur.execute("SELECT version, doc FROM cellstream_map ORDER BY version DESC LIMIT 1")
    except pymysql.err.ProgrammingError as exc:
        if code(exc) == NO_TABLE:  # a node created before the map was recorded, or a replica behind it
            return None
        raise
    row = cur.fetchone()
    return (int(row[0]), str(row[1])) if row else None


def write_version(cur: pymysql.cursors.Cursor, version: int, doc: str) -> bool:
    """Record ``version``; False when the node holds that version already (another writer's, or this one's)."""
    cur.execute(SCHEMA)
    return bool(cur.execute("INSERT IGNORE INTO cellstream_map (version, doc) VALUES (%s, %s)", (version, doc)))
