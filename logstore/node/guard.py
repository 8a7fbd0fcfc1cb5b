"""What a listening server (the worker node, the console) checks before it looks at a request's route: that the
request was meant for it (``Host``), that no web page sent it (``Origin``, ``Sec-Fetch-Site``), and that nobody
guesses its tokens (failed attempts limited per client and in all). Also the strength a token must have.

A browser sends any page's requests to 127.0.0.1: a cross-site form post without asking (no CORS preflight), and
after DNS rebinding a page of ``evil.example`` reaches a loopback server under its own origin, its requests
carrying ``Host: evil.example``. Refusing hosts that are neither an IP address, ``localhost`` nor allowed, and
requests a browser marks as sent from another site, closes both. The trust boundaries in full:
docs/security.md.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

MIN_TOKEN_LENGTH = 16
"""Characters a token must have at least: 16 random characters from a 64-symbol alphabet are 96 bits."""

_TRUSTED_FOR = 3600.0  # seconds a client that presented a valid token stays exempt from the overall limit


def check_token(value: str, what: str = "a token") -> str:
    """``value`` if it is strong enough to be a Bearer token or a console token.

    Raises:
        ValueError: shorter than :data:`MIN_TOKEN_LENGTH`, or holding whitespace or control characters
            (which an ``Authorization`` header cannot carry whole).
    """
    if len(value) < MIN_TOKEN_LENGTH:
        raise ValueError(f"{what} needs at least {MIN_TOKEN_LENGTH} characters (it has {len(value)}): "
                         "make one with `openssl rand -base64 32` or "
                         "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{what} cannot hold spaces or control characters")
    return value


# -- Host -------------------------------------------------------------------------------------------
def host_name(header: str) -> str:
    """The name or address of a ``Host`` header, without its port and brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):  # [v6]:port
        return header[1:].partition("]")[0]
    if header.count(":") > 1:  # a bare IPv6 address: no port can follow it unbracketed
        return header
    name, colon, port = header.rpartition(":")
    return name if colon and port.isdigit() else header


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostAllowList:
    """The ``Host`` values a server answers: any IP address, ``localhost`` and its subdomains (browsers keep
    them on loopback: RFC 6761), the name the server was bound to, and the ``allowed`` names (``*`` for any).

    A DNS-rebound page reaches a server under a name of its own; an IP address or ``localhost`` is never
    another site's origin, so they are always allowed. Without ``allowed``, a server with a token answers any
    name (the token is its boundary, and no browser holds it), one without a token only the names above.
    """

    def __init__(self, bind_host: str, allowed: Iterable[str] | None, *, authenticated: bool) -> None:
        names = {host_name(h) for h in allowed} if allowed is not None else ({"*"} if authenticated else set())
        names.add(host_name(bind_host))
        self.any = "*" in names
        self.names = frozenset(names - {"*", ""})

    def allows(self, header: str | None) -> bool:
        if self.any:
            return True
        if not header:  # HTTP/1.0 without Host: no browser sends such a request
            return True
        name = host_name(header)
        return (_is_address(name) or name == "localhost" or name.endswith(".localhost")
                or name in self.names)


def cross_site(origin: str | None, fetch_site: str | None, own_origin: str) -> str | None:
    """Why a request came from another site's page, or None. ``own_origin`` is ``scheme://host[:port]`` as
    the request addressed the server.

    Browsers mark every request with ``Sec-Fetch-Site`` (``same-origin``, ``same-site``, ``cross-site`` or
    ``none`` when a person typed the address) and cross-origin ones with ``Origin``; clients that are not
    browsers send neither. ``same-site`` is refused too: another port of the same host is another site's code.
    """
    if fetch_site is not None and fetch_site.strip().lower() not in ("same-origin", "none"):
        return f"sent by a page of another site (Sec-Fetch-Site: {fetch_site.strip()[:40]})"
    if origin is not None and origin != "null" and origin.rstrip("/").lower() != own_origin.lower():
        return f"sent by a page of another origin ({origin[:100]})"
    if origin == "null":
        return "sent by a page with an opaque origin (Origin: null)"
    return None


# -- failed tokens ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuthLimits:
    """How many failed token attempts a server takes: ``client_burst`` at once from one client address, then
    ``client_rate`` a second; ``overall_burst`` and ``overall_rate`` from all clients together."""

    client_burst: float = 10.0
    client_rate: float = 0.5
    overall_burst: float = 100.0
    overall_rate: float = 5.0
    max_clients: int = 10_000  # addresses remembered; the least recently seen are forgotten first


class _Bucket:
    __slots__ = ("at", "level")

    def __init__(self, level: float, at: float) -> None:
        self.level = level
        self.at = at

    def fill(self, now: float, burst: float, rate: float) -> float:
        self.level = min(burst, self.level + (now - self.at) * rate)
        self.at = now
        return self.level


class AuthThrottle:
    """Failed token attempts, limited per client address and in all (token buckets).

    A client past its own budget is refused before its token is even compared, so a guess made then tells
    nothing. Past the overall budget (many addresses guessing at once) every client is refused the same way
    but those that presented a valid token within the last hour: the apps and tailers that hold the token
    keep working through an attack, and a guesser learns nothing from the answers.
    """

    def __init__(self, limits: AuthLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or AuthLimits()
        self._clock = clock
        self._clients: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        self._trusted: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._overall = _Bucket(self.limits.overall_burst, clock())

    def attempt(self, client: str, presented: bytes, tokens: Mapping[str, bytes]) -> tuple[float, str | None]:
        """Which of ``tokens`` (by name) ``client`` presents, counted as a success or a failure.

        Returns:
            ``(0.0, name)``, ``(0.0, None)`` for a wrong token (or none), or ``(seconds, None)`` when the client
            must wait that long first: then nothing was compared.
        """
        wait = self.wait(client)
        if wait > 0:
            return wait, None
        held = next((name for name, token in tokens.items() if hmac.compare_digest(presented, token)), None)
        if held is None:
            self.failed(client)
        else:
            self.succeeded(client)
        return 0.0, held

    def wait(self, client: str) -> float:
        """Seconds ``client`` must wait before its next attempt is compared: 0.0 if it may try now."""
        now, limits = self._clock(), self.limits
        bucket = self._clients.get(client)
        if bucket is not None and bucket.fill(now, limits.client_burst, limits.client_rate) < 1:
            return (1 - bucket.level) / limits.client_rate
        if self._overall.fill(now, limits.overall_burst, limits.overall_rate) < 1 and not self._trusts(client, now):
            return (1 - self._overall.level) / limits.overall_rate
        return 0.0

    def failed(self, client: str) -> None:
        """``client`` presented a wrong token (or none where one is required)."""
        now, limits = self._clock(), self.limits
        bucket = self._clients.pop(client, None) or _Bucket(limits.client_burst, now)
        bucket.fill(now, limits.client_burst, limits.client_rate)
        bucket.level -= 1
        self._clients[client] = bucket  # now the most recently seen
        while len(self._clients) > limits.max_clients:
            self._clients.popitem(last=False)
        self._overall.fill(now, limits.overall_burst, limits.overall_rate)
        self._overall.level -= 1

    def succeeded(self, client: str) -> None:
        """``client`` presented a valid token: exempt from the overall limit for an hour."""
        self._trusted.pop(client, None)
        self._trusted[client] = self._clock()
        while len(self._trusted) > self.limits.max_clients:
            self._trusted.popitem(last=False)

    def _trusts(self, client: str, now: float) -> bool:
        seen = self._trusted.get(client)
        return seen is not None and now - seen < _TRUSTED_FOR


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
