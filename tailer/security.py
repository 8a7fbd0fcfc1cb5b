"""How every Kafka client of cellstream connects: TLS and SASL from Kafka's client properties.

The tailer's producer, a Kafka-mode app's consumer and its ``<app>.dlq`` producer, the connectors' Kafka
source and the ``status`` probes all take one :class:`KafkaSecurity`, written with the property names of
librdkafka (the names ``kcat -F`` and every librdkafka client read)::

    security.protocol=SASL_SSL
    sasl.mechanism=SCRAM-SHA-512
    sasl.username=cellstream
    sasl.password=...
    ssl.ca.location=/etc/cellstream/kafka-ca.pem

given as a file (``--kafka-config FILE``; :func:`load_kafka_config`) or, with the same keys, in an app's
options (``kafka={...}``) and a connector's YAML (``kafka:``). The file format is librdkafka's: one
``key=value`` per line, ``#`` comments, no escapes (so the same file works with ``kcat -F``); a Java-properties
parser would read backslashes in a password as escapes, which is why the few lines here parse it.

aiokafka reports a refused handshake or login only in its log and then raises a bare "Unable to bootstrap";
:func:`diagnose` opens one connection the same way to name the cause (a wrong password, an untrusted
certificate, a listener that wants another protocol).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from logstore.errors import AuthenticationError, CellstreamError, ConfigurationError
from logstore.tls import client_context

Protocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
Mechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
_SASL_KEYS = ("sasl_mechanism", "sasl_username", "sasl_password")
_SSL_KEYS = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password")
ENV = "CELLSTREAM_KAFKA_CONFIG"


def _prop(name: str, *more: str) -> Any:
    """The validation aliases of a field: the Kafka property name, any other spelling, the Python name."""
    return AliasChoices(name, *more, name.replace(".", "_"))


class KafkaSecurity(BaseModel):
    """TLS and SASL settings of a Kafka client, under Kafka's client property names (see the module).

    Secrets are :class:`~pydantic.SecretStr`: they print as ``**********`` in reprs, logs and errors.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)

    security_protocol: Protocol = Field(
        "PLAINTEXT", validation_alias=_prop("security.protocol"), serialization_alias="security.protocol")
    sasl_mechanism: Mechanism | None = Field(
        None, validation_alias=_prop("sasl.mechanism", "sasl.mechanisms"), serialization_alias="sasl.mechanism")
    sasl_username: str | None = Field(
        None, min_length=1, validation_alias=_prop("sasl.username"), serialization_alias="sasl.username")
    sasl_password: SecretStr | None = Field(
        None, validation_alias=_prop("sasl.password"), serialization_alias="sasl.password")
    ssl_ca_location: Path | None = Field(
        None, description="a CA file or directory; default: the system's CAs",
        validation_alias=_prop("ssl.ca.location"), serialization_alias="ssl.ca.location")
    ssl_certificate_location: Path | None = Field(
        None, description="this client's certificate (PEM), for listeners that require one",
        validation_alias=_prop("ssl.certificate.location"), serialization_alias="ssl.certificate.location")
    ssl_key_location: Path | None = Field(
        None, validation_alias=_prop("ssl.key.location"), serialization_alias="ssl.key.location")
    ssl_key_password: SecretStr | None = Field(
        None, validation_alias=_prop("ssl.key.password"), serialization_alias="ssl.key.password")
    ssl_endpoint_identification_algorithm: Literal["https", "none"] = Field(
        "https", description="https: the broker's certificate must name the host connected to",
        validation_alias=_prop("ssl.endpoint.identification.algorithm"),
        serialization_alias="ssl.endpoint.identification.algorithm")

    @model_validator(mode="before")
    @classmethod
    def _case(cls, data: Any) -> Any:
        # librdkafka takes protocol names in any case, and an empty identification algorithm for "none".
        if isinstance(data, dict):
            data = dict(data)
            for key in ("security.protocol", "security_protocol"):
                if isinstance(data.get(key), str):
                    data[key] = data[key].upper()
            for key in ("ssl.endpoint.identification.algorithm", "ssl_endpoint_identification_algorithm"):
                if isinstance(data.get(key), str):
                    data[key] = data[key].lower() or "none"
        return data

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        sasl, tls = self.security_protocol.startswith("SASL_"), self.security_protocol.endswith("SSL")
        if sasl:
            missing = [_name(k) for k in _SASL_KEYS if getattr(self, k) is None]
            if missing:
                raise ValueError(f"security.protocol {self.security_protocol} needs {', '.join(missing)}")
        for key in (() if sasl else _SASL_KEYS) + (() if tls else _SSL_KEYS):
            if getattr(self, key) is not None:
                raise ValueError(f"{_name(key)} is set but security.protocol {self.security_protocol} "
                                 "would not use it")
        if (self.ssl_certificate_location is None) != (self.ssl_key_location is None):
            raise ValueError("ssl.certificate.location and ssl.key.location go together")
        for key in ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location"):
            path = getattr(self, key)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{_name(key)} {str(path)!r} cannot be read")
        return self

    @property
    def tls(self) -> bool:
        return self.security_protocol.endswith("SSL")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the connection (None without TLS); the broker's certificate is always verified."""
        if not self.tls:
            return None
        return client_context(
            "Kafka TLS (ssl.*)", ca=self.ssl_ca_location, cert=self.ssl_certificate_location,
            key=self.ssl_key_location,
            key_password=self.ssl_key_password.get_secret_value() if self.ssl_key_password else None,
            check_hostname=self.ssl_endpoint_identification_algorithm == "https")

    def client_options(self) -> dict[str, Any]:
        """aiokafka's keyword arguments (producer, consumer, admin client, connection)."""
        options: dict[str, Any] = {"security_protocol": self.security_protocol, "ssl_context": self.ssl_context()}
        if self.sasl_mechanism is not None:
            assert self.sasl_password is not None
            options.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                           sasl_plain_password=self.sasl_password.get_secret_value())
        return options

    def librdkafka_config(self) -> dict[str, str]:
        """librdkafka's properties (a Kafka-mode app's consumer), secrets in clear: never log them.
        Without a CA, librdkafka probes the system's usual CA locations (as aiokafka uses the system's CAs)."""
        config = {key: str(value) for key, value in self.model_dump(exclude_none=True, mode="json").items()}
        for key in ("sasl.password", "ssl.key.password"):
            secret = getattr(self, key.replace(".", "_"))
            if secret is not None:
                config[key] = secret.get_secret_value()
        if not self.tls:
            config.pop("ssl.endpoint.identification.algorithm", None)
        elif self.ssl_ca_location is None:
            config["ssl.ca.location"] = "probe"
        return config

    def masked(self) -> dict[str, str]:
        """The settings under their property names, secrets masked: what may be shown or logged."""
        out = {}
        for key, value in self.model_dump(exclude_defaults=True, mode="json").items():
            out[key] = "**********" if key.endswith("password") else str(value)
        out.setdefault("security.protocol", self.security_protocol)
        return out


PLAINTEXT = KafkaSecurity()


def _name(field: str) -> str:
    return field.replace("_", ".")


def parse_kafka_config(data: object, where: str) -> KafkaSecurity:
    """A KafkaSecurity from ``data`` (a mapping of property names, a KafkaSecurity or None); errors name
    ``where`` (the file or option) and the property."""
    if data is None:
        return PLAINTEXT
    if isinstance(data, KafkaSecurity):
        return data
    try:
        return KafkaSecurity.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        problem = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            problem = "not a Kafka client property cellstream takes (security.*, sasl.*, ssl.*; see docs/security.md)"
        raise ConfigurationError(f"{where}: {key + ': ' if key else ''}{problem}") from None


def load_kafka_config(path: str | os.PathLike[str]) -> KafkaSecurity:
    """Read a librdkafka-style properties file (see the module)."""
    where = f"Kafka config {os.fspath(path)}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigurationError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{where}: cannot be read ({exc.__class__.__name__}: {exc})") from None
    data: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"{where} line {number}: expected key=value")
        key = key.strip()
        if key in data:
            raise ConfigurationError(f"{where} line {number}: {key} is set twice")
        data[key] = value.strip()
    return parse_kafka_config(data, where)


def resolve_kafka_config(path: str | os.PathLike[str] | None) -> KafkaSecurity:
    """``--kafka-config`` if given, else the file in CELLSTREAM_KAFKA_CONFIG, else plaintext."""
    path = path or os.environ.get(ENV) or None
    return load_kafka_config(path) if path else PLAINTEXT


async def diagnose(brokers: str, security: KafkaSecurity, timeout: float = 10.0) -> CellstreamError | None:
    """Why a client cannot bootstrap from ``brokers``, found by one connection to each broker in turn: an
    AuthenticationError for refused credentials, a ConfigurationError for a failed TLS handshake or a
    protocol the listener does not speak; None when a broker accepts the connection (the failure was
    elsewhere) or none answers at all (unreachable, not misconfigured)."""
    from aiokafka.conn import create_conn
    from aiokafka.errors import KafkaConnectionError, KafkaError, SaslAuthenticationFailed

    found: CellstreamError | None = None
    for host, _, port in (b.strip().rpartition(":") for b in brokers.split(",") if b.strip()):
        where = f"Kafka at {host}:{port} ({security.security_protocol}"
        where += f", {security.sasl_mechanism} as {security.sasl_username})" if security.sasl_mechanism else ")"
        for _attempt in range(2):  # a broker that is shutting down closes connections too: it must happen twice
            try:
                conn = await asyncio.wait_for(create_conn(
                    host, int(port), client_id="cellstream-diagnose", request_timeout_ms=int(timeout * 1000),
                    **security.client_options()), timeout)
            except SaslAuthenticationFailed as exc:
                return AuthenticationError(f"{where} refused the credentials: {exc.args[0] if exc.args else exc}")
            except ssl.SSLCertVerificationError as exc:
                return ConfigurationError(f"{where}: the broker's certificate is not trusted: {exc.verify_message} "
                                          "(check ssl.ca.location and ssl.endpoint.identification.algorithm)")
            except ssl.SSLError as exc:
                return ConfigurationError(f"{where}: the TLS handshake failed: {exc.reason or exc}")
            except KafkaConnectionError as exc:
                # Closed by the broker before it answered: a listener that speaks another protocol, or an SSL
                # listener that requires a client certificate this client did not present.
                hint = "does security.protocol match the listener"
                if security.tls and security.ssl_certificate_location is None:
                    hint += ", or does it require a client certificate (ssl.certificate.location)"
                found = ConfigurationError(f"{where}: the broker closed the connection ({exc}); {hint}?")
                continue
            except (TimeoutError, OSError, KafkaError):
                found = None  # unreachable: not a configuration problem
                break
            conn.close()
            return None
        if found is not None:
            return found
    return None
