"""indexer: the stream-processing runtime and secondary indexes (built in a later issue)."""
