"""Who is using the console: a login with the console's token, a session cookie, a CSRF token per session.

Sessions live in the server's memory, so a restart logs everyone out and a session id gives away nothing.
That is why the cookie holds only a random id rather than a signed session (``aiohttp-session`` would
add a dependency and a cookie key to manage, for one dict). The name given at login is the *actor*
recorded in the history of every entry the person changes.
"""

from __future__ import annotations

import hmac
import secrets
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from cellstream.errors import LoginError, LoginThrottled
from logstore.node.guard import AuthLimits, AuthThrottle

COOKIE = "cellstream_console"
MAX_SESSIONS = 10_000
_NAME_LENGTH = 64


@dataclass(slots=True)
class Session:
    id: str
    actor: str
    csrf: str
    seen: float
    jobs: list[int] = field(default_factory=list)


SESSION = web.RequestKey("session", Session)  # the request's Session, once authenticated


def session_of(request: web.Request) -> Session:
    """The session of an authenticated request (the server's check put it there); KeyError before that."""
    return request[SESSION]


def check_name(name: str) -> str:
    """The name a person logs in with, stripped: 1 to 64 printable characters."""
    name = name.strip()
    if not name:
        raise LoginError("give your name: it is recorded with every change you make")
    if len(name) > _NAME_LENGTH:
        raise LoginError(f"a name has at most {_NAME_LENGTH} characters")
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise LoginError("a name cannot hold control characters")
    return name


class Sessions:
    """The logged-in sessions; ``token`` None: the console listens on loopback and asks only for a name.
    Wrong tokens, at the login and as a scraper's Bearer header, are limited per client address and in all
    (:class:`~logstore.node.guard.AuthThrottle`)."""

    def __init__(self, token: str | None, ttl: float, clock: Callable[[], float] = time.monotonic,
                 limits: AuthLimits | None = None) -> None:
        self._token = token.encode() if token is not None else None
        self.ttl = ttl
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self.throttle = AuthThrottle(limits, clock)

    @property
    def token_required(self) -> bool:
        return self._token is not None

    def login(self, name: str, token: str, client: str = "") -> Session:
        """A new session for ``name``, if ``token`` is the console's.

        Raises:
            LoginThrottled: ``client`` (or every client) gave too many wrong tokens lately.
            LoginError: no name, or a wrong token.
        """
        actor = check_name(name)
        if self._token is not None and not self._token_ok(token.encode(), client):
            raise LoginError("wrong token")
        self._expire()
        if len(self._sessions) >= MAX_SESSIONS:
            oldest = min(self._sessions.values(), key=lambda s: s.seen)
            del self._sessions[oldest.id]
        session = Session(secrets.token_urlsafe(32), f"console:{actor}", secrets.token_urlsafe(32), self._clock())
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The session of a cookie's value, None if unknown or idle for longer than the ttl."""
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        now = self._clock()
        if session is None or now - session.seen > self.ttl:
            self._sessions.pop(session_id, None)
            return None
        session.seen = now
        return session

    def logout(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def bearer_ok(self, header: str | None, client: str = "") -> bool:
        """An ``Authorization: Bearer`` header with the token (for /metrics scrapers); True without a token.

        Raises:
            LoginThrottled: as :meth:`login`.
        """
        if self._token is None:
            return True
        scheme, _, value = (header or "").partition(" ")
        return scheme.lower() == "bearer" and self._token_ok(value.strip().encode(), client)

    def _token_ok(self, presented: bytes, client: str) -> bool:
        assert self._token is not None
        wait, held = self.throttle.attempt(client, presented, {"token": self._token})
        if wait > 0:
            raise LoginThrottled(wait)
        return held is not None

    @staticmethod
    def csrf_ok(session: Session, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), session.csrf.encode())

    def _expire(self) -> None:
        now = self._clock()
        for stale in [s.id for s in self._sessions.values() if now - s.seen > self.ttl]:
            del self._sessions[stale]
