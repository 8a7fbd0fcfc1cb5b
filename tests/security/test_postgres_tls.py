"""The PostgreSQL sink over TLS, against a real PostgreSQL that serves TLS with a certificate from the test's CA
and whose pg_hba.conf rejects every unencrypted TCP connection, lets ``tls`` in with a password and
``cellstream`` only with a client certificate. psql reads the loaded rows back over the same URL."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import logstore
from cellstream.cli.main import main
from connectors.config import PostgresSinkConfig, load_connector
from connectors.sinks.base import Position
from connectors.sinks.postgres import PostgresSink
from logstore.errors import AuthenticationError, ConfigurationError
from tests.connectors.test_connect_postgres import SHARDS, config_file, psql, trip
from tests.harness.private_postgres import PrivatePostgreSQL, scratch_dir
from tests.harness.tls import PKI, make_pki

PASSWORD = "pg-s3cret"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[PrivatePostgreSQL, PKI]]:
    workdir = scratch_dir("pg-tls")
    pki = make_pki(workdir / "pki")
    pg = PrivatePostgreSQL(workdir / "pg", options=[
        "ssl=on", f"ssl_cert_file={pki.server.cert}", f"ssl_key_file={pki.server.key}", f"ssl_ca_file={pki.ca}"],
        hba=["hostssl all cellstream 127.0.0.1/32 cert", "hostnossl all all 127.0.0.1/32 reject",
             "hostssl all all 127.0.0.1/32 scram-sha-256"])
    (workdir / "pki").chmod(0o755)
    for path in (workdir / "pki").iterdir():
        pg.own(path)  # the server reads its key; the client files are read by this (root) process anyway
    try:
        pg.start()
        with psycopg.connect(host=str(pg.workdir), port=pg.port, user="cellstream", dbname="postgres",
                             autocommit=True) as admin:
            admin.execute(f"CREATE USER tls PASSWORD '{PASSWORD}'")
        yield pg, pki
    finally:
        pg.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def database(pg: PrivatePostgreSQL, owner: str = "tls") -> str:
    name = f"w_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(host=str(pg.workdir), port=pg.port, user="cellstream", dbname="postgres",
                         autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} OWNER {owner}")
    return name


def load(tmp_path: Path, sqlite_url: str, url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(n)) for n in range(20)])
    code = main(["connect", "run", str(config_file(tmp_path, url)), "--drain", "--store", sqlite_url, "--json"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def connect(tmp_path: Path, url: str) -> None:
    """The sink's first flush, which connects."""
    config = load_connector(config_file(tmp_path, url)).sink
    assert isinstance(config, PostgresSinkConfig)
    sink = PostgresSink(config)
    cell = logstore.Cell(row_key=uuid.uuid4(), column="BASE", ref_key=1, body=trip(1), shard=0, added_id=1,
                         created_at=dt.datetime.now(dt.UTC))
    sink.add(cell, Position(0, 1))
    sink.flush()


def test_verify_full_with_a_password_loads_and_psql_reads_it_back(
        server: tuple[PrivatePostgreSQL, PKI], tmp_path: Path, sqlite_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    pg, pki = server
    url = f"{pg.url(database(pg), 'tls', PASSWORD)}?sslmode=verify-full&sslrootcert={pki.ca}"
    code, output = load(tmp_path, sqlite_url, url, capsys)
    assert code == 0, output
    assert json.loads(output.splitlines()[-1])["processed"] == 20 and PASSWORD not in output
    assert psql(url, "SELECT count(*) FROM cells_base") == [["20"]]
    assert psql(url, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()") == [["t"]]


def test_a_client_certificate_logs_in_a_user_the_server_admits_only_with_one(
        server: tuple[PrivatePostgreSQL, PKI], tmp_path: Path, sqlite_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    pg, pki = server
    url = (f"{pg.url(database(pg, 'cellstream'), 'cellstream', None)}?sslmode=verify-full&sslrootcert={pki.ca}"
           f"&sslcert={pki.client.cert}&sslkey={pki.client.key}")
    code, output = load(tmp_path, sqlite_url, url, capsys)
    assert code == 0, output
    assert psql(url, "SELECT count(*) FROM cells_base") == [["20"]]


@pytest.mark.parametrize(("query", "kind", "problem"), [
    ("sslmode=disable", AuthenticationError, "pg_hba.conf rejects connection"),
    ("sslmode=verify-full&sslrootcert={other_ca}", ConfigurationError, "certificate verify failed"),
])
def test_a_refused_connection_is_a_typed_error_at_once_and_never_shows_the_password(
        server: tuple[PrivatePostgreSQL, PKI], tmp_path: Path, sqlite_url: str,
        capsys: pytest.CaptureFixture[str], query: str, kind: type[Exception], problem: str) -> None:
    pg, pki = server
    url = f"{pg.url(database(pg), 'tls', PASSWORD)}?{query.format(other_ca=pki.other_ca)}"
    code, output = load(tmp_path, sqlite_url, url, capsys)
    assert code == 4, output
    lines = [line for line in output.splitlines() if line.startswith("cellstream: error:")]
    assert len(lines) == 1 and problem in lines[0] and PASSWORD not in output
    with pytest.raises(kind, match=problem):
        connect(tmp_path, url)


def test_a_wrong_password_is_an_authentication_error(server: tuple[PrivatePostgreSQL, PKI], tmp_path: Path) -> None:
    pg, pki = server
    url = f"{pg.url(database(pg), 'tls', 'wrong-password')}?sslmode=verify-full&sslrootcert={pki.ca}"
    with pytest.raises(AuthenticationError, match='password authentication failed for user "tls"'):
        connect(tmp_path, url)


def test_an_unknown_url_parameter_or_sslmode_is_refused_when_the_file_is_read(tmp_path: Path) -> None:
    for query, problem in (("sslmod=require", 'invalid URI query parameter: "sslmod"'),
                           ("sslmode=strict", "sslmode 'strict' must be one of disable, allow, prefer")):
        with pytest.raises(ConfigurationError, match=problem):
            load_connector(config_file(tmp_path, f"postgresql://u:p@127.0.0.1:5432/w?{query}"))


@pytest.mark.parametrize("url", ["postgresql://loader:hunter2-secret@[::1/warehouse",
                                 "loader:hunter2-secret@127.0.0.1/warehouse",
                                 "postgresql://loader:hunter2-secret@127.0.0.1/w%zz"])
def test_a_malformed_url_is_refused_without_its_password(tmp_path: Path, url: str) -> None:
    """libpq quotes the part of a URL it cannot parse, password and all: the refusal must not."""
    with pytest.raises(ConfigurationError) as refused:
        load_connector(config_file(tmp_path, url))
    message = str(refused.value)
    assert "hunter2" not in message and "url" in message, message
