"""Fixtures: a fresh SQLite directory, MariaDB database, PostgreSQL database, ZooKeeper chroot,
Kafka topic prefix or S3 bucket per test; and the service markers, put on every test from what it uses.

The servers are the real ones: the session starts those its selected tests need (``shared_servers``, from
tests/harness/servers.py; their addresses are in tests/harness/shared_servers.py), after
scripts/install.sh installed them (`make test` runs both). A server that cannot start fails the tests,
with CI=true or not; nothing here skips or mocks it. `make unit` deselects the tests marked with a service instead.

A test is marked ``mysql``, ``postgres``, ``kafka``, ``zookeeper`` or ``s3`` (pyproject.toml declares them) when
  - it uses a fixture of SERVICE_FIXTURES, directly or through other fixtures;
  - one of its parameters is a service's name: a fixture or test parametrized over backends
    (``params=["sqlite", "mysql"]``) gets the service fixture with ``request.getfixturevalue`` for that
    param only, so the sqlite case stays unmarked;
  - its module starts a private server of the harness (PRIVATE_SERVERS: tests/harness/services.py,
    tests/harness/private_mariadb.py, private_postgres.py), which needs what `make test` installs.
A service fixture requested without its marker (getfixturevalue without the param naming it) fails the test,
so no test can reach a server while `make unit` selects it.
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.private_postgres import PrivatePostgreSQL
from tests.harness.services import PrivateKafka, PrivateZooKeeper
from tests.harness.shared_servers import (
    KAFKA,
    MYSQL_REPLICA,
    MYSQL_SERVER,
    POSTGRES_SERVER,
    POSTGRES_SOURCE_SERVER,
    S3_CREDENTIAL,
    S3_ENDPOINT,
    S3_IDENTITY,
    ZOOKEEPER,
    mysql_admin,
    postgres_admin,
    s3_admin,
)

SERVICES = ("mysql", "postgres", "postgres_source", "kafka", "zookeeper", "s3")
SERVICE_FIXTURES = {
    "mysql_database": "mysql",
    "replicated_database": "mysql",
    "mysql_database_factory": "mysql",
    "postgres_database": "postgres",
    "postgres_source_database": "postgres_source",
    "zk_chroot": "zookeeper",
    "topic_prefix": "kafka",
    "s3_destination": "s3",
}
# The environment variables that point the suite at servers of one's own (tests/harness/shared_servers.py).
OVERRIDES = {"mysql": "CELLSTREAM_TEST_MYSQL", "postgres": "CELLSTREAM_TEST_POSTGRES",
             "postgres_source": "CELLSTREAM_TEST_POSTGRES_SOURCE", "kafka": "CELLSTREAM_TEST_KAFKA",
             "zookeeper": "CELLSTREAM_TEST_ZOOKEEPER", "s3": "CELLSTREAM_TEST_S3"}
PRIVATE_SERVERS: dict[type, str] = {PrivateMariaDB: "mysql", PrivatePostgreSQL: "postgres", PrivateKafka: "kafka",
                                    PrivateZooKeeper: "zookeeper"}


def services_of(item: pytest.Item) -> set[str]:
    """The services a collected test needs, by its fixtures, its parameters and its module."""
    needs = {SERVICE_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in SERVICE_FIXTURES}
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        needs |= {value for value in callspec.params.values() if isinstance(value, str) and value in SERVICES}
    module = getattr(item, "module", None)
    if module is not None:
        started = {id(value) for value in vars(module).values()}
        needs |= {service for server, service in PRIVATE_SERVERS.items() if id(server) in started}
    return needs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for service in sorted(services_of(item)):
            if item.get_closest_marker(service) is None:
                item.add_marker(service)


@pytest.fixture(scope="session", autouse=True)
def shared_servers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Start the shared servers the selected tests need (tests/harness/servers.py), unless they answer already
    or the environment points the suite at other ones; stop, at the end, exactly the ones started here."""
    from tests.harness import servers

    markers = {marker for item in request.session.items for marker in SERVICES if item.get_closest_marker(marker)}
    names = [name for marker in sorted(markers) if not os.environ.get(OVERRIDES[marker])
             for name in servers.BY_MARKER[marker]]
    started = servers.up(names) if names else []
    try:
        yield
    finally:
        servers.down(started)


@pytest.fixture(autouse=True)
def _process_tuning() -> Iterator[None]:
    """Each test leaves the garbage collector's thresholds and frozen objects, and the switch interval, as
    it found them: a tail command run in-process tunes them for its process
    (cellstream.cli.common.tune_for_streaming), which is this one."""
    before, interval = gc.get_threshold(), sys.getswitchinterval()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()
    sys.setswitchinterval(interval)


def _needs(request: pytest.FixtureRequest, service: str) -> None:
    """Fail a test that reaches ``service`` without its marker (it would run, and fail, under `make unit`)."""
    if request.node.get_closest_marker(service) is None:
        pytest.fail(f"{request.node.nodeid} uses {request.fixturename}, which needs {service}, but is not marked "
                    f"{service}: request it as an argument, or with getfixturevalue only under a param named "
                    f"{service!r} (see tests/conftest.py)", pytrace=False)


# -- MariaDB (the logstore's server backend) -------------------------------------------
@pytest.fixture
def mysql_database(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a new, empty database; dropped after the test."""
    _needs(request, "mysql")
    name = f"cst_{uuid.uuid4().hex[:12]}"
    admin = mysql_admin()
    try:
        yield f"{MYSQL_SERVER.rstrip('/')}/{name}"
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


@pytest.fixture
def replicated_database(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(primary URL, replica URL) of a new, empty database that MariaDB replicates; dropped after the test."""
    _needs(request, "mysql")
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
def mysql_database_factory(request: pytest.FixtureRequest) -> Iterator[Callable[[], str]]:
    """Make several fresh databases (a cluster's nodes); all dropped after the test."""
    _needs(request, "mysql")
    mysql_admin().close()  # fail now, naming the server, when it is not there
    names: list[str] = []

    def make() -> str:
        name = f"cst_{uuid.uuid4().hex[:12]}"
        names.append(name)
        return f"{MYSQL_SERVER.rstrip('/')}/{name}"

    yield make
    if names:
        admin = mysql_admin()
        with admin.cursor() as cur:
            for name in names:
                cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


# -- PostgreSQL (the warehouse the connectors load) -----------------------------------
@pytest.fixture
def postgres_database(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database; dropped after the test."""
    _needs(request, "postgres")
    name = f"cst_{uuid.uuid4().hex[:12]}"
    with postgres_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{POSTGRES_SERVER.rstrip('/')}/{name}"
    finally:
        with postgres_admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_source_database(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a new, empty database on the PostgreSQL with wal_level=logical (a migration's source); dropped
    after the test, with the replication slots left on it (a slot holds the server's log)."""
    _needs(request, "postgres_source")
    name = f"cst_{uuid.uuid4().hex[:12]}"
    with postgres_admin(POSTGRES_SOURCE_SERVER) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{POSTGRES_SOURCE_SERVER.rstrip('/')}/{name}"
    finally:
        with postgres_admin(POSTGRES_SOURCE_SERVER) as admin:
            admin.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                          (name,))
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- SQLite (the embedded default: no server) ------------------------------------------
@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store'}"


# -- Kafka and ZooKeeper (the shared servers of tests/harness/servers.py) -----
@pytest.fixture
def zk_chroot(request: pytest.FixtureRequest) -> Iterator[str]:
    """A ZooKeeper connect string with a fresh chroot (``host:port/cst-<hex>``); removed after the test."""
    from kazoo.client import KazooClient
    from kazoo.handlers.threading import KazooTimeoutError

    _needs(request, "zookeeper")
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
def topic_prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh topic prefix on the shared Kafka; its topics are deleted after the test."""
    from tests.harness.kafka_support import delete_topics, require_kafka

    _needs(request, "kafka")
    require_kafka(KAFKA)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    yield prefix
    delete_topics(KAFKA, prefix)


# -- S3-compatible object storage (S3Proxy, where object-storage backups are tested) --------
class S3Destination(NamedTuple):
    """A backup destination in a fresh bucket: its ``s3://bucket/prefix`` URL and the environment that gives
    its endpoint and credentials (what ``logstore.backup.storage.open_storage(url, env=env)`` reads)."""

    url: str
    env: dict[str, str]
    bucket: str


@pytest.fixture
def s3_destination(request: pytest.FixtureRequest) -> Iterator[S3Destination]:
    """``s3://cst-<hex>/backups`` in a new bucket of the shared S3Proxy; the bucket and all in it are deleted
    after the test."""
    _needs(request, "s3")
    admin = s3_admin()
    bucket = f"cst-{uuid.uuid4().hex[:12]}"
    admin.create_bucket(Bucket=bucket)
    env = {"AWS_ACCESS_KEY_ID": S3_IDENTITY, "AWS_SECRET_ACCESS_KEY": S3_CREDENTIAL,
           "CELLSTREAM_S3_ENDPOINT": S3_ENDPOINT}
    try:
        yield S3Destination(f"s3://{bucket}/backups", env, bucket)
    finally:
        for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                admin.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        admin.delete_bucket(Bucket=bucket)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Name the threads a test left running: one still inside a driver when the interpreter finalizes can
    crash it after every test passed (a segfault that turns a green run red)."""
    import threading

    left = [thread for thread in threading.enumerate() if thread is not threading.main_thread()]
    if left:
        names = ", ".join(sorted(f"{thread.name} ({getattr(thread, '_target', None)!r})" for thread in left))
        session.config.get_terminal_writer().line(f"threads left running at the end: {names}")
