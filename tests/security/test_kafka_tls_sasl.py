"""Every Kafka client of cellstream over TLS and SASL, against a real broker with a SASL_SSL listener (PLAIN,
SCRAM-SHA-256, SCRAM-SHA-512) and an SSL listener that requires client certificates, all from a CA the test
makes. kcat reads the topics back with the same properties file (``kcat -F``), as an outside consumer would."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import logstore
from cellstream.cli.main import main
from indexer import App
from logstore.errors import AuthenticationError, ConfigurationError
from tailer.security import load_kafka_config
from tests.connectors.test_connect_parquet import CONFIG, SHARDS, lake, source, trips
from tests.harness.cli_process import run_until
from tests.harness.kafka_support import cell_ids, kcat_read, publish
from tests.harness.services import PrivateKafka, SecuredListeners
from tests.harness.tls import PKI, make_pki

USER, PASSWORD = "cellstream", "s3cret pass#1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def kafka(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateKafka]:
    listeners = SecuredListeners(keystore=pki.server.combined, truststore=pki.ca, users={USER: PASSWORD})
    with PrivateKafka(tmp_path_factory.mktemp("kafka"), security=listeners) as server:
        yield server


def properties(path: Path, **values: object) -> Path:
    path.write_text("".join(f"{key.replace('_', '.')}={value}\n" for key, value in values.items()))
    return path


def sasl(tmp_path: Path, pki: PKI, mechanism: str = "SCRAM-SHA-512", password: str = PASSWORD,
         ca: Path | None = None) -> Path:
    return properties(tmp_path / f"sasl-{mechanism}.properties", security_protocol="SASL_SSL",
                      sasl_mechanism=mechanism, sasl_username=USER, sasl_password=password,
                      ssl_ca_location=ca or pki.ca)


def write(store: logstore.Store, n: int, column: str = "BASE", **extra: object) -> set[tuple[int, int]]:
    return {(c.shard, c.added_id) for c in store.put_cells([(uuid.uuid4(), column, 1, {"n": i, **extra})
                                                            for i in range(n)])}


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_the_tailer_publishes_over_sasl_ssl_with_each_mechanism(
        kafka: PrivateKafka, pki: PKI, tmp_path: Path, sqlite_url: str, mechanism: str) -> None:
    config = sasl(tmp_path, pki, mechanism)
    prefix = f"s{uuid.uuid4().hex[:8]}"
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        written = write(store, 40)
        publish(store, prefix, brokers=kafka.sasl_ssl_bootstrap, security=load_kafka_config(config))
    assert set(cell_ids(kcat_read(kafka.sasl_ssl_bootstrap, f"{prefix}.BASE", str(config)))) == written


def test_cellstream_tail_with_kafka_config_publishes_and_never_prints_the_password(
        kafka: PrivateKafka, pki: PKI, tmp_path: Path, sqlite_url: str) -> None:
    config = sasl(tmp_path, pki)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        written = write(store, 30)
    output = run_until(
        ["tail", "-v", "--store", sqlite_url, "--brokers", kafka.sasl_ssl_bootstrap, "--kafka-config", str(config),
         "--offsets", str(tmp_path / "offsets.json"), "--name", prefix, "--prefix", prefix, "--partitions", "2"],
        lambda: set(cell_ids(kcat_read(kafka.sasl_ssl_bootstrap, f"{prefix}.BASE", str(config)))) == written)
    assert PASSWORD not in output


def test_a_kafka_mode_app_consumes_and_mirrors_dead_letters_over_sasl_ssl(
        kafka: PrivateKafka, pki: PKI, tmp_path: Path, sqlite_url: str) -> None:
    config = sasl(tmp_path, pki, "SCRAM-SHA-256")
    prefix = f"a{uuid.uuid4().hex[:8]}"
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        good = write(store, 30)
        bad = write(store, 2, poison=True)
        publish(store, prefix, brokers=kafka.sasl_ssl_bootstrap, security=load_kafka_config(config))
        seen: set[tuple[int, int]] = set()
        app = App(f"{prefix}-app", store=store, brokers=kafka.sasl_ssl_bootstrap, topic_prefix=prefix,
                  kafka=str(config))

        @app.trigger("BASE", max_attempts=1)
        def handle(cell: logstore.Cell) -> None:
            if cell.body.get("poison"):
                raise ValueError("declined")
            seen.add((cell.shard, cell.added_id))

        with app:
            assert app.drain(timeout=90) == (30, 0, 2)
        assert seen == good
        mirrored = kcat_read(kafka.sasl_ssl_bootstrap, f"{prefix}-app.dlq", str(config))
        assert {m.key for m in mirrored} == {e.id for e in app.dlq.list()}
        assert {(e.cell["shard"], e.cell["added_id"]) for e in app.dlq.list()} == bad


def test_a_connector_reads_kafka_over_tls_with_a_client_certificate_from_its_yaml(
        kafka: PrivateKafka, pki: PKI, tmp_path: Path, sqlite_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    mtls = {"security.protocol": "SSL", "ssl.ca.location": pki.ca, "ssl.certificate.location": pki.client.cert,
            "ssl.key.location": pki.client.key}
    path = tmp_path / "sink.yaml"
    path.write_text(CONFIG.format(interval=0.2, rows=100_000) + f"brokers: {kafka.ssl_bootstrap}\n"
                    f"topic_prefix: {prefix}\nkafka:\n" + "".join(f"  {k}: {v}\n" for k, v in mtls.items()))
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        trips(store, 40)
        publish(store, prefix, brokers=kafka.ssl_bootstrap, security=load_kafka_config(
            properties(tmp_path / "mtls.properties", **{k.replace(".", "_"): v for k, v in mtls.items()})))
        code = main(["connect", "run", str(path), "--drain", "--store", sqlite_url, "--json"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert json.loads(captured.out.splitlines()[-1])["processed"] == 80
        for column in ("BASE", "FARE"):
            assert lake(tmp_path / "lake", column) == source(store, column)
        assert main(["connect", "status", str(path), "--store", sqlite_url, "--json"]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert rows and all(row["lag_messages"] == 0 for row in rows)


def test_a_wrong_password_is_an_authentication_error_naming_the_user_and_never_the_password(
        kafka: PrivateKafka, pki: PKI, tmp_path: Path, sqlite_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    wrong = "not-the-password-42"
    config = sasl(tmp_path, pki, "SCRAM-SHA-512", password=wrong)
    logstore.open(sqlite_url, shards=SHARDS).close()
    code = main(["tail", "--store", sqlite_url, "--brokers", kafka.sasl_ssl_bootstrap, "--kafka-config", str(config),
                 "--offsets", str(tmp_path / "o.json"), "--name", "t"])
    err = capsys.readouterr().err
    assert code == 4, err
    line = [x for x in err.splitlines() if x.startswith("cellstream: error:")]
    assert len(line) == 1 and "SCRAM-SHA-512 as cellstream) refused the credentials" in line[0], err
    assert wrong not in err
    app = App("wrong", store=sqlite_url, brokers=kafka.sasl_ssl_bootstrap, kafka=str(config))
    app.trigger("BASE")(lambda cell: None)
    with pytest.raises(AuthenticationError, match="refused the credentials") as caught:
        app.drain(timeout=30)
    assert wrong not in str(caught.value)


def test_an_untrusted_broker_certificate_and_a_missing_client_certificate_are_named(
        kafka: PrivateKafka, pki: PKI, tmp_path: Path, sqlite_url: str) -> None:
    no_cert = properties(tmp_path / "ssl.properties", security_protocol="SSL", ssl_ca_location=pki.ca)
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        with pytest.raises(ConfigurationError, match="the broker's certificate is not trusted"):
            publish(store, "u", brokers=kafka.sasl_ssl_bootstrap,
                    security=load_kafka_config(sasl(tmp_path, pki, ca=pki.other_ca)))
        with pytest.raises(ConfigurationError, match="require a client certificate"):
            publish(store, "u", brokers=kafka.ssl_bootstrap, security=load_kafka_config(no_cert))
