"""tailer: tails every shard log of a logstore and publishes its cells, in per-shard order, to Kafka
topics (or to the handlers of a direct-mode app); workers share the shards through ZooKeeper or
through the store, and commit a position only after its deliveries were acknowledged."""
