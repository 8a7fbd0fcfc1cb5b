"""TLS contexts: for clients, one way for every server cellstream connects to (MySQL/MariaDB here, Kafka in the
tailer); for cellstream's own servers (the worker node, the console), :func:`server_context`.

The server's certificate is checked against ``ca`` (a PEM file or a directory; the system's CAs when None)
unless ``verify`` is off, and its name against the host connected to when ``check_hostname`` is on; a
client certificate is presented when ``cert`` and ``key`` are given. Files that cannot be loaded are a
:class:`~logstore.errors.ConfigurationError` naming the setting (``what``) and the file.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from logstore.errors import ConfigurationError


def server_context(cert: Path, key: Path | None) -> ssl.SSLContext:
    """A server's context with its certificate (chain) and key; files that cannot be loaded are a
    ConfigurationError naming both."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigurationError(f"the TLS certificate {str(cert)!r} and key {str(key)!r} cannot be loaded: "
                                 f"{exc}") from None
    return context


def client_context(what: str, *, ca: Path | None = None, cert: Path | None = None, key: Path | None = None,
                   key_password: str | None = None, verify: bool = True,
                   check_hostname: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif ca is not None:
        try:
            if ca.is_dir():
                context.load_verify_locations(capath=ca)
            else:
                context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigurationError(f"{what}: the CA {str(ca)!r} holds no usable certificate: {exc}") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key, key_password)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigurationError(
                f"{what}: the client certificate {str(cert)!r} and key {str(key)!r} cannot be loaded "
                f"({type(exc).__name__}: {exc}; a wrong or missing key password?)") from None
    if verify:
        context.check_hostname = check_hostname
    return context
