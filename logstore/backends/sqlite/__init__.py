"""The SQLite backend, the embedded default: its URL (``target.py``), the recorder and its index tables."""
