"""The shared servers of tests/harness/servers.py (which the test session starts): their addresses, overridable by
environment variables, and admin connections that fail the test, naming the server, when it is not there.

Tests get their own database, chroot or topic prefix on them through the fixtures of tests/conftest.py; a test
that stops, kills or restarts a server starts a private one instead (services.py, private_mariadb.py).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest

MYSQL_SERVER = os.environ.get("CELLSTREAM_TEST_MYSQL", "mysql://cellstream:cellstream@127.0.0.1:3306")
# The replica of MYSQL_SERVER that tests/harness/servers.py starts; it applies the csr_* databases.
MYSQL_REPLICA = os.environ.get("CELLSTREAM_TEST_MYSQL_REPLICA", "mysql://cellstream:cellstream@127.0.0.1:3307")
# The warehouse the connectors load.
POSTGRES_SERVER = os.environ.get("CELLSTREAM_TEST_POSTGRES", "postgresql://cellstream:cellstream@127.0.0.1:5432")
# The migration tests' source: a PostgreSQL with wal_level=logical (logical decoding through a replication slot).
POSTGRES_SOURCE_SERVER = os.environ.get("CELLSTREAM_TEST_POSTGRES_SOURCE",
                                        "postgresql://cellstream:cellstream@127.0.0.1:5433")
KAFKA = os.environ.get("CELLSTREAM_TEST_KAFKA", "127.0.0.1:9092")
ZOOKEEPER = os.environ.get("CELLSTREAM_TEST_ZOOKEEPER", "127.0.0.1:2181")
# The S3-compatible object store (S3Proxy) the object-storage backup tests write to, and its one identity.
S3_PORT = 8333
S3_ENDPOINT = os.environ.get("CELLSTREAM_TEST_S3", f"http://127.0.0.1:{S3_PORT}")
S3_IDENTITY = os.environ.get("CELLSTREAM_TEST_S3_ACCESS_KEY", "cellstream")
S3_CREDENTIAL = os.environ.get("CELLSTREAM_TEST_S3_SECRET_KEY", "cellstream-secret")


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


def postgres_admin(server: str = POSTGRES_SERVER) -> Any:
    import psycopg

    try:
        return psycopg.connect(f"{server.rstrip('/')}/postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {server.split('@')[-1]} ({exc}); run the suite "
                    "with `make test`, which installs and starts it", pytrace=False)


def s3_admin() -> Any:
    """A boto3 S3 client of the shared S3Proxy (S3_ENDPOINT), with its identity; fails the test, naming the
    server, when it does not answer."""
    import boto3
    import botocore.config
    import botocore.exceptions

    client = boto3.client("s3", endpoint_url=S3_ENDPOINT, region_name="us-east-1", aws_access_key_id=S3_IDENTITY,
                          aws_secret_access_key=S3_CREDENTIAL,
                          config=botocore.config.Config(connect_timeout=5, s3={"addressing_style": "path"}))
    try:
        client.list_buckets()
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        pytest.fail(f"S3Proxy is not reachable at {S3_ENDPOINT} with {S3_IDENTITY!r} ({exc}); run the suite with "
                    "`make test`, which installs and starts it", pytrace=False)
    return client
