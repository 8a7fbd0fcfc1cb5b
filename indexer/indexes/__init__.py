"""Secondary indexes as a runtime feature: definitions, the catalog of versions, the applier that
keeps the tables, backfill, verify and the group commit that combines changes."""
