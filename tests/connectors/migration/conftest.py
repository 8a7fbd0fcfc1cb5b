"""The migration tests' source table, on each kind of source server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.connectors.migration.test_mover import SourceDB, create_table


@pytest.fixture(params=["postgres_source", "mysql"])  # named for their markers (tests/conftest.py)
def source_db(request: pytest.FixtureRequest) -> Iterator[SourceDB]:
    """The ``trips`` table (2,000 rows) on a PostgreSQL with logical decoding, then on the MariaDB."""
    postgres = request.param == "postgres_source"
    url = request.getfixturevalue("postgres_source_database" if postgres else "mysql_database")
    db = SourceDB("postgres" if postgres else "mysql", url)
    create_table(db)
    yield db
    db.close()
