"""Certificates for the security tests: a test CA (trustme) and PEM files for servers and clients.

Each test session makes its own CA, so nothing is trusted beyond the files written here. Keys are written as
unencrypted PKCS#8 (``BEGIN PRIVATE KEY``), the one form every server here reads (Kafka's PEM keystore takes
no other); trustme writes the traditional OpenSSL form, hence the re-encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography.hazmat.primitives import serialization

HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Pem:
    """A certificate (with its chain) and its key, as files."""

    cert: Path
    key: Path

    @property
    def combined(self) -> Path:
        """Key then certificate chain in one file (what Kafka's PEM keystore reads)."""
        return self.cert.with_suffix(".keystore.pem")


@dataclass(frozen=True)
class PKI:
    ca: Path
    server: Pem
    client: Pem
    other_ca: Path  # a CA that signed nothing here: trusting only it must fail the handshake
    wrong_host: Pem  # signed by ``ca`` for a name that is not 127.0.0.1: fails only an identity check


def _pkcs8(key_pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(directory: Path, name: str, cert: trustme.LeafCert) -> Pem:
    pem = Pem(directory / f"{name}.crt", directory / f"{name}.key")
    chain = b"".join(blob.bytes() for blob in cert.cert_chain_pems)
    key = _pkcs8(cert.private_key_pem.bytes())
    pem.cert.write_bytes(chain)
    pem.key.write_bytes(key)
    pem.key.chmod(0o600)
    pem.combined.write_bytes(key + chain)
    pem.combined.chmod(0o600)
    return pem


def make_pki(directory: Path) -> PKI:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate (CN ``cellstream``),
    another CA, and a certificate for the wrong host."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.crt"))
    other.cert_pem.write_to_path(str(directory / "other-ca.crt"))
    return PKI(
        ca=directory / "ca.crt",
        server=_write(directory, "server", ca.issue_cert(*HOSTS, common_name="127.0.0.1")),
        client=_write(directory, "client", ca.issue_cert("cellstream", common_name="cellstream")),
        other_ca=directory / "other-ca.crt",
        wrong_host=_write(directory, "wrong-host", ca.issue_cert("db.example.com", common_name="db.example.com")),
    )
