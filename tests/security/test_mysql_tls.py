"""MySQL/MariaDB storage nodes over TLS (store URLs and cluster files), against a real MariaDB that serves TLS
with a certificate from the test's CA and has users who must connect with TLS (REQUIRE SSL) or with a client
certificate (REQUIRE X509): that such a user gets in proves the connection was what the URL asked for."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest

import logstore
from logstore.config import parse_node_url
from logstore.errors import AuthenticationError, ConfigurationError
from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.stores import two_nodes
from tests.harness.tls import PKI, Pem, make_pki

PASSWORD = "tls-s3cret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_server(workdir: Path, pki: PKI, cert: Pem) -> PrivateMariaDB:
    db = PrivateMariaDB(workdir, options=[f"--ssl-ca={pki.ca}", f"--ssl-cert={cert.cert}", f"--ssl-key={cert.key}"])
    db.start()
    root = pymysql.connect(unix_socket=str(db.socket), user="root", autocommit=True)
    try:
        with root.cursor() as cur:
            for user, require in (("tls", "SSL"), ("x509", "X509")):
                cur.execute(f"CREATE USER IF NOT EXISTS '{user}'@'%' IDENTIFIED BY '{PASSWORD}' REQUIRE {require}")
                cur.execute(f"GRANT ALL PRIVILEGES ON *.* TO '{user}'@'%'")
    finally:
        root.close()
    return db


@pytest.fixture(scope="module")
def server(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMariaDB]:
    db = tls_server(tmp_path_factory.mktemp("mariadb"), pki, pki.server)
    try:
        yield db
    finally:
        db.stop()


def url(db: PrivateMariaDB, user: str, query: str, database: str | None = None) -> str:
    return f"mysql://{user}:{PASSWORD}@127.0.0.1:{db.port}/{database or 'tls_' + uuid.uuid4().hex[:8]}?{query}"


def roundtrip(target: str | Path) -> None:
    with logstore.open(target, shards=16) as store:
        written = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(40)])
        for cell in written:
            assert store.get_cell(cell.row_key, "BASE", 1) == cell


def test_a_url_with_ssl_ca_verifies_the_server_and_its_name_by_default(server: PrivateMariaDB, pki: PKI) -> None:
    target = url(server, "tls", f"ssl_ca={pki.ca}")
    assert parse_node_url(target).ssl_mode == "VERIFY_IDENTITY"  # type: ignore[union-attr]
    roundtrip(target)


def test_without_ssl_parameters_tls_is_preferred_and_used_when_the_server_offers_it(server: PrivateMariaDB) -> None:
    target = url(server, "tls", "")  # the user "tls" may only connect with TLS
    assert parse_node_url(target).ssl_mode == "PREFERRED"  # type: ignore[union-attr]
    roundtrip(target)


def test_a_cluster_file_of_nodes_with_client_certificates(server: PrivateMariaDB, pki: PKI, tmp_path: Path) -> None:
    query = f"ssl_ca={pki.ca}&ssl_cert={pki.client.cert}&ssl_key={pki.client.key}"
    roundtrip(two_nodes(tmp_path / "cluster.toml", [url(server, "x509", query), url(server, "x509", query)], 16))
    with pytest.raises(AuthenticationError, match="Access denied for user 'x509'"):
        roundtrip(url(server, "x509", f"ssl_ca={pki.ca}"))  # the same user without its certificate


def test_tls_disabled_for_a_user_that_requires_it_is_an_authentication_error_without_the_password(
        server: PrivateMariaDB) -> None:
    with pytest.raises(AuthenticationError) as caught:
        roundtrip(url(server, "tls", "ssl_mode=DISABLED"))
    assert "Access denied for user 'tls'" in str(caught.value) and PASSWORD not in str(caught.value)
    assert not caught.value.retriable


def test_a_server_certificate_from_another_ca_is_refused_at_once_as_a_configuration_error(
        server: PrivateMariaDB, pki: PKI) -> None:
    with pytest.raises(ConfigurationError, match=r"certificate verify failed.*TLS: check the URL's") as caught:
        roundtrip(url(server, "tls", f"ssl_ca={pki.other_ca}"))
    assert not caught.value.retriable and PASSWORD not in str(caught.value)


def test_verify_identity_refuses_a_certificate_for_another_host_that_verify_ca_accepts(
        pki: PKI, tmp_path: Path) -> None:
    db = tls_server(tmp_path / "wrong-host", pki, pki.wrong_host)
    try:
        with pytest.raises(ConfigurationError, match=r"certificate verify failed.*match"):
            roundtrip(url(db, "tls", f"ssl_ca={pki.ca}"))
        roundtrip(url(db, "tls", f"ssl_ca={pki.ca}&ssl_mode=VERIFY_CA"))
    finally:
        db.stop()
