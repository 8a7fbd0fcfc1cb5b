"""Warehouse sinks: the base (add/flush) and its Parquet lake, Apache Iceberg and PostgreSQL implementations."""
