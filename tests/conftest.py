"""Fixtures: a fresh SQLite directory, MariaDB database, PostgreSQL database, ZooKeeper chroot or
Kafka topic prefix per test.

The servers are the real ones `make test` starts (scripts/services.sh). A missing
server fails the tests that need it; nothing here skips or mocks it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest

MYSQL_SERVER = os.environ.get("CELLSTREAM_TEST_MYSQL", "mysql://cellstream:cellstream@127.0.0.1:3306")
# The replica of MYSQL_SERVER that scripts/services.sh starts; it applies the csr_* databases.
MYSQL_REPLICA = os.environ.get("CELLSTREAM_TEST_MYSQL_REPLICA", "mysql://cellstream:cellstream@127.0.0.1:3307")


def mysql_admin(server: str = MYSQL_SERVER) -> pymysql.connections.Connection:
    parts = urlsplit(server)
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
def replicated_database() -> Iterator[tuple[str, str]]:
    """(primary URL, replica URL) of a new, empty database that MariaDB replicates; dropped after the test."""
    name = f"csr_{uuid.uuid4().hex[:12]}"
    admin = mysql_admin()
    mysql_admin(MYSQL_REPLICA).close()  # fail now, naming the replica, when it is not there
    try:
        yield f"{MYSQL_SERVER.rstrip('/')}/{name}", f"{MYSQL_REPLICA.rstrip('/')}/{name}"
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


# -- PostgreSQL (the warehouse the connectors load) -----------------------------------
POSTGRES_SERVER = os.environ.get("CELLSTREAM_TEST_POSTGRES", "postgresql://cellstream:cellstream@127.0.0.1:5432")


def postgres_admin() -> Any:
    import psycopg

    try:
        return psycopg.connect(f"{POSTGRES_SERVER.rstrip('/')}/postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {POSTGRES_SERVER.split('@')[-1]} ({exc}); run the suite "
                    "with `make test`, which installs and starts it", pytrace=False)


@pytest.fixture
def postgres_database() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database; dropped after the test."""
    name = f"cst_{uuid.uuid4().hex[:12]}"
    with postgres_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{POSTGRES_SERVER.rstrip('/')}/{name}"
    finally:
        with postgres_admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store'}"


# -- Kafka and ZooKeeper (the shared servers of scripts/services.sh) ------------------
KAFKA = os.environ.get("CELLSTREAM_TEST_KAFKA", "127.0.0.1:9092")
ZOOKEEPER = os.environ.get("CELLSTREAM_TEST_ZOOKEEPER", "127.0.0.1:2181")


@pytest.fixture
def zk_chroot() -> Iterator[str]:
    """A ZooKeeper connect string with a fresh chroot (``host:port/cst-<hex>``); removed after the test."""
    from kazoo.client import KazooClient
    from kazoo.handlers.threading import KazooTimeoutError

    chroot = f"/cst-{uuid.uuid4().hex[:12]}"
    client = KazooClient(hosts=ZOOKEEPER, timeout=10)
    try:
        client.start(timeout=15)
    except KazooTimeoutError:
        pytest.fail(f"ZooKeeper is not reachable at {ZOOKEEPER}; run the suite with `make test`, "
                    "which installs and starts it", pytrace=False)
    try:
        yield ZOOKEEPER + chroot
    finally:
        client.delete(chroot, recursive=True)
        client.stop()
        client.close()


@pytest.fixture
def topic_prefix() -> Iterator[str]:
    """A fresh topic prefix on the shared Kafka; its topics are deleted after the test."""
    from .kafka_support import delete_topics, require_kafka

    require_kafka(KAFKA)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    yield prefix
    delete_topics(KAFKA, prefix)
