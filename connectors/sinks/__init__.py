"""Warehouse sinks: the base (add/flush) and its Parquet lake and PostgreSQL implementations."""
