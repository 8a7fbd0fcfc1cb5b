"""Connectors: the Parquet sink, `cellstream connect` into the lake and into PostgreSQL."""
