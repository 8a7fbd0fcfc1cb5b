"""Denormalized, sharded secondary-index tables: the index version spec, its records, the abstract
recorder every backend implements (:mod:`.persistence`) and the many-node front (:mod:`.store`)."""
