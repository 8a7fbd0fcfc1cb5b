"""TLS and SASL settings without a server: Kafka client properties (tailer.security: the file format, the
checks, where they may be given) and the TLS parameters of mysql:// URLs. The connections themselves are
tested against the real servers in the other modules here."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trustme

import logstore
from cellstream.cli.main import main
from connectors.config import load_connector
from indexer import App
from logstore.config import parse_node_url
from logstore.errors import ConfigurationError, InvalidArgumentError
from tailer.security import KafkaSecurity, load_kafka_config, parse_kafka_config
from tests.connectors.test_connect_parquet import CONFIG

SECRET = "s3cret pass#=1"


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    path = tmp_path / "ca.crt"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_librdkafka_style_file_is_read_with_comments_case_and_a_password_holding_hash_and_equals(
        tmp_path: Path, ca: Path) -> None:
    path = write(tmp_path / "k.properties",
                 f"# the cluster's credentials\n\nsecurity.protocol = sasl_ssl\nsasl.mechanisms=SCRAM-SHA-512\n"
                 f"sasl.username=cellstream\nsasl.password={SECRET}\n  ssl.ca.location={ca}\n")
    security = load_kafka_config(path)
    assert security.security_protocol == "SASL_SSL" and security.sasl_mechanism == "SCRAM-SHA-512"
    assert security.sasl_password is not None and security.sasl_password.get_secret_value() == SECRET
    options = security.client_options()
    assert options["sasl_plain_username"] == "cellstream" and options["ssl_context"].check_hostname is True
    assert SECRET not in repr(security) and SECRET not in str(security.masked())
    assert security.masked()["sasl.password"] == "**********"


@pytest.mark.parametrize(("text", "problem"), [
    ("security.protocol=SASL_SSL\nsasl.username=u\nsasl.password=p\n", "needs sasl.mechanism"),
    ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\nsasl.password=p\n", "needs sasl.username"),
    ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=GSSAPI\nsasl.username=u\nsasl.password=p\n",
     "sasl.mechanism: Input should be 'PLAIN', 'SCRAM-SHA-256' or 'SCRAM-SHA-512'"),
    ("security.protocol=SSL\nsasl.username=u\n", "sasl.username is set but security.protocol SSL would not use it"),
    ("sasl.password=p\n", "sasl.password is set but security.protocol PLAINTEXT would not use it"),
    ("security.protocol=SSL\nssl.certificate.location={ca}\n", "ssl.certificate.location and ssl.key.location go"),
    ("security.protocol=SSL\nssl.ca.location=/nonexistent/ca.pem\n", "ssl.ca.location '/nonexistent/ca.pem' cannot"),
    ("security.protocol=TLS\n", "security.protocol: Input should be"),
    ("ssl.truststore.location=/x.jks\n", "ssl.truststore.location: not a Kafka client property cellstream takes"),
    ("security.protocol=SSL\nsecurity.protocol=SSL\n", "line 2: security.protocol is set twice"),
    ("security.protocol\n", "line 1: expected key=value"),
])
def test_each_problem_in_the_file_is_a_configuration_error_naming_the_property(
        tmp_path: Path, ca: Path, text: str, problem: str) -> None:
    path = write(tmp_path / "k.properties", text.format(ca=ca))
    with pytest.raises(ConfigurationError) as err:
        load_kafka_config(path)
    assert str(err.value).startswith(f"Kafka config {path}")
    assert problem in str(err.value)


def test_a_ca_file_without_a_certificate_is_named_when_the_client_is_made(tmp_path: Path) -> None:
    path = write(tmp_path / "k.properties", f"security.protocol=SSL\nssl.ca.location={write(tmp_path / 'x', 'x')}\n")
    with pytest.raises(ConfigurationError, match=r"Kafka TLS .* holds no usable certificate"):
        load_kafka_config(path).client_options()


def test_a_missing_file_is_named() -> None:
    with pytest.raises(ConfigurationError, match=r"Kafka config /nonexistent/k\.properties: no such file"):
        load_kafka_config("/nonexistent/k.properties")


def test_an_app_takes_the_same_keys_or_a_file_and_only_in_kafka_mode(tmp_path: Path, ca: Path,
                                                                    sqlite_url: str) -> None:
    keys = {"security.protocol": "SSL", "ssl.ca.location": str(ca)}
    app = App("a", store=sqlite_url, brokers="127.0.0.1:1", kafka=keys)
    assert app.config.kafka == parse_kafka_config(keys, "test")
    path = write(tmp_path / "k.properties", f"security.protocol=SSL\nssl.ca.location={ca}\n")
    assert App("a", store=sqlite_url, brokers="127.0.0.1:1", kafka=str(path)).config.kafka == app.config.kafka
    with pytest.raises(ConfigurationError, match=r"kafka= .* is for Kafka mode"):
        App("a", store=sqlite_url, kafka=keys)
    with pytest.raises(ConfigurationError, match=r"app option kafka\.sasl\.mechanism"):
        App("a", store=sqlite_url, brokers="127.0.0.1:1", kafka={"sasl.mechanism": "NTLM"})


def test_a_connector_takes_the_keys_or_a_file_relative_to_it_and_only_with_brokers(tmp_path: Path, ca: Path) -> None:
    base = CONFIG.format(interval=1, rows=10)
    inline = write(tmp_path / "inline.yaml", base + "brokers: 127.0.0.1:1\nkafka:\n  security.protocol: SSL\n"
                                                    f"  ssl.ca.location: {ca}\n")
    write(tmp_path / "kafka.properties", f"security.protocol=SSL\nssl.ca.location={ca}\n")
    from_file = write(tmp_path / "file.yaml", base + "brokers: 127.0.0.1:1\nkafka: kafka.properties\n")
    assert load_connector(inline).kafka_security == load_connector(from_file).kafka_security
    assert load_connector(from_file).kafka_security.security_protocol == "SSL"
    without = write(tmp_path / "without.yaml", base + "kafka:\n  security.protocol: SSL\n")
    with pytest.raises(ConfigurationError, match="TLS and SASL settings are for a connector that reads Kafka"):
        load_connector(without)


def test_the_cli_refuses_kafka_config_where_nothing_reads_kafka(
        tmp_path: Path, sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "k.properties", "security.protocol=SSL\n")
    logstore.open(sqlite_url, shards=8).close()
    code = main(["tail", "--store", sqlite_url, "--out", str(tmp_path / "out"), "--offsets",
                 str(tmp_path / "o.json"), "--name", "t", "--kafka-config", str(path)])
    assert code == 2 and "--kafka-config is for --brokers" in capsys.readouterr().err
    code = main(["run", "cellstream.demo.examples.billing:app", "--drain", "--store", sqlite_url,
                 "--kafka-config", str(path)])
    err = capsys.readouterr().err
    assert code == 4 and "direct-mode app" in err and err.count("\n") == 1


def test_the_model_takes_python_names_too() -> None:
    security = KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                             sasl_password="p")
    assert security.client_options()["security_protocol"] == "SASL_PLAINTEXT"
    assert security.client_options()["ssl_context"] is None


def test_librdkafka_gets_the_same_properties_with_the_secrets_in_clear_and_the_system_cas_without_a_ca(
        ca: Path) -> None:
    """A Kafka-mode app's consumer (librdkafka) is configured by the property names the file uses."""
    sasl = KafkaSecurity.model_validate({"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                         "sasl.username": "u", "sasl.password": "p#=w"})
    assert sasl.librdkafka_config() == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u",
        "sasl.password": "p#=w", "ssl.endpoint.identification.algorithm": "https", "ssl.ca.location": "probe"}
    tls = KafkaSecurity.model_validate({"security.protocol": "SSL", "ssl.ca.location": str(ca),
                                        "ssl.endpoint.identification.algorithm": "none"})
    assert tls.librdkafka_config() == {"security.protocol": "SSL", "ssl.ca.location": str(ca),
                                       "ssl.endpoint.identification.algorithm": "none"}
    assert KafkaSecurity().librdkafka_config() == {"security.protocol": "PLAINTEXT"}


@pytest.mark.parametrize(("query", "problem"), [
    ("sslmode=require", "mysql URL parameter 'sslmode' is not one cellstream takes (ssl_mode, ssl_ca, ssl_cert"),
    ("ssl_mode=STRICT", "mysql URL ssl_mode 'STRICT' must be one of DISABLED, PREFERRED, REQUIRED, VERIFY_CA"),
    ("ssl_ca=/nonexistent/ca.pem", "mysql URL ssl_ca '/nonexistent/ca.pem' cannot be read"),
    ("ssl_cert={ca}", "mysql URL ssl_cert and ssl_key go together"),
    ("ssl_mode=DISABLED&ssl_ca={ca}", "mysql URL ssl_mode DISABLED would ignore ssl_ca"),
    ("ssl_ca={ca}&ssl_ca={ca}", "mysql URL parameter ssl_ca is given twice"),
    ("ssl_ca", "mysql URL query 'ssl_ca' cannot be parsed"),
])
def test_each_bad_tls_parameter_of_a_mysql_url_is_named(ca: Path, query: str, problem: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_node_url(f"mysql://u:pw@db:3306/cells?{query.format(ca=ca)}")
    assert problem in str(err.value)


def test_mysql_tls_modes_default_from_what_the_url_gives_and_the_redacted_url_keeps_them(ca: Path) -> None:
    plain = parse_node_url("mysql://u:pw@db:3306/cells")
    assert plain.ssl_mode == "PREFERRED"  # type: ignore[union-attr]
    preferred = plain.ssl_options()["ssl"]  # type: ignore[union-attr]
    assert preferred.verify_mode == ssl.CERT_NONE and not preferred.check_hostname
    assert plain.ssl_options()["ssl"] is preferred  # type: ignore[union-attr]  # made once: loading CAs costs ~20 ms
    verified = parse_node_url(f"mysql://u:pw@db:3306/cells?ssl_ca={ca}")
    assert verified.ssl_mode == "VERIFY_IDENTITY"  # type: ignore[union-attr]
    assert verified.ssl_options()["ssl"].check_hostname  # type: ignore[union-attr]
    assert verified.redacted() == f"mysql://u:***@db:3306/cells?ssl_mode=VERIFY_IDENTITY&ssl_ca={ca}"
    unverified = parse_node_url("mysql://u:pw@db:3306/cells?ssl_mode=required")
    assert unverified.ssl_options()["ssl"].verify_mode == 0  # type: ignore[union-attr]  # ssl.CERT_NONE
    assert parse_node_url("mysql://u:pw@db/c?ssl_mode=DISABLED").ssl_options() == {"ssl_disabled": True}  # type: ignore[union-attr]
