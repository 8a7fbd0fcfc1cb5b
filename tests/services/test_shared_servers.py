"""The shared servers of tests/harness/servers.py (started or reused by the test session): they answer, and a test's
fresh database on them is empty and writable."""

from __future__ import annotations

import pytest

from tests.harness.services import kafka_brokers, zk_four_letter
from tests.harness.shared_servers import KAFKA, ZOOKEEPER


# The one test that reaches a shared server without a fixture (tests/conftest.py marks those): marked here.
@pytest.mark.kafka
@pytest.mark.zookeeper
def test_shared_services_answer() -> None:
    """The servers the session starts (or reuses) for the suite."""
    answer = zk_four_letter(ZOOKEEPER, "ruok")
    if answer != "imok":  # a ZooKeeper with the default 4lw whitelist still answers srvr
        answer = zk_four_letter(ZOOKEEPER, "srvr")
        assert answer.startswith("Zookeeper version:"), (
            f"ZooKeeper does not answer on {ZOOKEEPER}; run the suite with `make test`"
        )
    assert kafka_brokers(KAFKA), f"Kafka does not answer on {KAFKA}; run the suite with `make test`"


def test_a_fresh_postgres_database_is_empty_and_writable(postgres_database: str) -> None:
    """The shared PostgreSQL: each test gets its own database, with JSONB and COPY."""
    import psycopg

    with psycopg.connect(postgres_database, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)
        conn.execute("CREATE TABLE t (k int PRIMARY KEY, body jsonb)")
        with conn.cursor() as cur, cur.copy("COPY t (k, body) FROM STDIN") as copy:
            copy.write_row((1, '{"a": [1, 2]}'))
        assert conn.execute("SELECT body -> 'a' ->> 1 FROM t").fetchone() == ("2",)


@pytest.mark.mysql
@pytest.mark.postgres
@pytest.mark.kafka
@pytest.mark.zookeeper
@pytest.mark.s3
def test_up_reuses_every_server_that_answers_and_starts_none() -> None:
    """The session started (or reused) every server its tests need; another `up` finds each answering, so it
    starts nothing and has nothing of its own to stop. The replica replicates."""
    from tests.harness import servers

    assert servers.up(servers.SERVERS) == []
    replica = servers.MariaDBReplica()
    assert replica.answers()
    replica.replicate()  # returns once the replica's IO and SQL threads both run
