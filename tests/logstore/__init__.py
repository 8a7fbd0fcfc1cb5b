"""The logstore: cells, retries, the SQLite and MariaDB backends, replication, buffered writes, shard moves."""
