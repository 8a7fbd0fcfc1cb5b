"""A migration's source opened from its declaration: the backend of its URL's kind, with the names of what it
keeps on the source (a replication slot and publication, a position row) derived from the migration's name."""

from __future__ import annotations

import zlib
from urllib.parse import urlsplit

from connectors.migration.source import MigrationSource
from connectors.migration.spec import MigrationSpec
from logstore.extras import require


def capture_name(spec: MigrationSpec) -> str:
    """The name of the migration's slot and publication on a PostgreSQL source: ``cellstream_<name>_<hash>``,
    the hash of its database, schema and table, as a replication slot's name is the whole server's (two
    databases migrating a table under one name must not share a slot)."""
    source = spec.source
    database = urlsplit(source.url.get_secret_value()).path.lstrip("/")
    where = f"{database}/{source.schema_name or 'public'}/{source.table}"
    return f"cellstream_{spec.name.replace('-', '_')[:40]}_{zlib.crc32(where.encode()):08x}"  # 63 at most


def open_source(spec: MigrationSpec, *, capture: bool = True) -> MigrationSource:
    """The source table of ``spec``.

    Args:
        capture: whether the change capture is used (else rows only: no slot is named, for a facade's reads
            and writes).

    Raises:
        MigrationSourceError: the table cannot be read as a migration's source.
        MigrationSourceUnavailableError: the server did not answer (retriable).
        MissingExtraError: the extra of the source's driver is not installed.
    """
    url = spec.source.url.get_secret_value()
    if spec.source.kind == "postgres":
        require("postgres", "a PostgreSQL migration source")
        from connectors.migration.sources.postgres import PostgresSource

        name = capture_name(spec) if capture else ""
        return PostgresSource(url, spec.source.table, slot=name, publication=name,
                              schema=spec.source.schema_name or "public")
    require("migrate", "a MySQL/MariaDB migration source")
    from connectors.migration.sources.mysql import MySQLSource

    return MySQLSource(url, spec.source.table, replicas=[r.get_secret_value() for r in spec.source.replicas])
