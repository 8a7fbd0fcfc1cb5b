"""Where tailed cells go: Kafka (:mod:`.kafka`) or directories of JSON lines (:mod:`.directory`)."""
