"""connectors: warehouse ingestion sinks (built in a later issue)."""
