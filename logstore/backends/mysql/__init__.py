"""The MySQL/MariaDB backend: its URL (``target.py``, TLS options included), recorder, connection pool,
driver-error boundary, buffered writes, index tables and shard moves (needs ``cellstream[mysql]``)."""
