"""The stream-processing runtime: the app, its handlers, the retry/dead-letter policy, the DLQ, and
the two ways cells arrive (direct mode and Kafka mode)."""
