"""Fixtures: a fresh SQLite directory or a fresh MariaDB database per test.

The MariaDB server is the real one `make test` starts (scripts/services.sh).
A missing server fails the tests that need it; nothing here skips or mocks it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pymysql
import pytest

MYSQL_SERVER = os.environ.get("CELLSTREAM_TEST_MYSQL", "mysql://cellstream:cellstream@127.0.0.1:3306")


def mysql_admin() -> pymysql.connections.Connection:
    parts = urlsplit(MYSQL_SERVER)
    try:
        return pymysql.connect(
            host=parts.hostname, port=parts.port or 3306, user=parts.username,
            password=parts.password or "", autocommit=True, connect_timeout=5,
        )
    except pymysql.err.OperationalError as exc:
        pytest.fail(
            f"MariaDB is not reachable at {parts.hostname}:{parts.port} ({exc.args[1]}); "
            "run the suite with `make test`, which installs and starts it",
            pytrace=False,
        )


@pytest.fixture
def mysql_database() -> Iterator[str]:
    """The URL of a new, empty database; dropped after the test."""
    name = f"cst_{uuid.uuid4().hex[:12]}"
    admin = mysql_admin()
    try:
        yield f"{MYSQL_SERVER.rstrip('/')}/{name}"
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


@pytest.fixture
def mysql_database_factory() -> Iterator[object]:
    """Make several fresh databases (a cluster's nodes); all dropped after the test."""
    names: list[str] = []

    def make() -> str:
        name = f"cst_{uuid.uuid4().hex[:12]}"
        names.append(name)
        return f"{MYSQL_SERVER.rstrip('/')}/{name}"

    yield make
    admin = mysql_admin()
    with admin.cursor() as cur:
        for name in names:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    admin.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store'}"
