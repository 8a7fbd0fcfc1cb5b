"""cellstream: the CLI, configuration and demo over logstore, tailer, indexer and connectors."""

__version__ = "0.1.0"
