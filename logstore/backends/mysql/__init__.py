"""The MySQL/MariaDB backend: recorder, connection pool, driver-error boundary, buffered writes,
index tables and shard moves (needs ``cellstream[mysql]``)."""
