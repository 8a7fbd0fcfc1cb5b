"""connectors: warehouse ingestion. A sink (:mod:`connectors.sinks.base`) is ``add(cell, position)`` + ``flush()``;
:mod:`connectors.sinks.parquet` writes a Hive-style Parquet lake that replays cannot duplicate."""
