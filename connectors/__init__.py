"""connectors: warehouse ingestion. A sink (:mod:`connectors.sink`) is ``add(cell, position)`` + ``flush()``;
:mod:`connectors.parquet` writes a Hive-style Parquet lake that replays cannot duplicate."""
