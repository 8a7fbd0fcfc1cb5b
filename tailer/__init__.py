"""tailer: publishes every shard log of a logstore to Kafka topics (built in a later issue)."""
