"""The app runtime (indexer.App): direct mode, Kafka mode, distributed; retries and the DLQ in each."""
