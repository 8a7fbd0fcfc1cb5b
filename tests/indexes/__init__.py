"""Secondary indexes: definitions, index tables, the runtime, versions, verify, the group commit."""
