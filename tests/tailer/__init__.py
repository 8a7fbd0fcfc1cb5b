"""The tailer: assignment, order, shards, standalone mode, Kafka and ZooKeeper, faults."""
