"""The SQLite backend, the embedded default: the recorder and its index tables."""
