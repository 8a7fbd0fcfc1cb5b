"""The backends of :class:`connectors.migration.source.MigrationSource`, one module each."""
