"""The storage backends by URL scheme, :data:`BACKENDS`: the one place a store URL is resolved
(:func:`logstore.open`, the cluster file, :func:`parse_node_url`).

Each backend is whole in its folder under ``logstore/backends/``: ``target.py`` (its URL's model and parser,
TLS options included; no driver imported) and a :class:`~logstore.persistence.NodeRecorder`. A new backend is
a folder and an entry here (docs/development.md, "Adding a storage backend"). Its parts are named as
``module:name`` strings, imported when first used: a URL is parsed without its driver.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from logstore.errors import InvalidArgumentError


class NodeTarget(Protocol):
    """A parsed store URL (a backend's pydantic model, frozen)."""

    def redacted(self) -> str:
        """The URL without its secrets, for messages and logs."""
        ...


@dataclass(frozen=True)
class Backend:
    """One storage backend: where its parts are (``module:name``, imported when first used) and what it takes."""

    what: str  #: names it in messages: "a MySQL/MariaDB store"
    prefix: str  #: the start of its URLs: "mysql://"
    parser: str  #: URL -> its target model
    recorder: str  #: the NodeRecorder class: ``(name, target, options, **takes)``
    extra: str | None = None  #: the extra (``cellstream[extra]``) its recorder needs
    storage_node: bool = True  #: may be a node of a cluster file (False: opened by its URL only)
    replicas: bool = False  #: takes ``replicas=`` (the cluster file's replica URLs, parsed)
    token: bool = False  #: takes ``token=`` (logstore.open's token argument)
    password: bool = False  #: its URL's user part holds a password (given apart by :func:`with_password`)

    def parse(self, url: str) -> NodeTarget:
        """The target model of ``url``; InvalidArgumentError when it does not parse."""
        parse: Callable[[str], NodeTarget] = load(self.parser)
        return parse(url)


_WORKER_NODE = Backend("a worker node", "http://", "logstore.backends.http.target:parse_url",
                       "logstore.backends.http.recorder:HttpRecorder", storage_node=False, token=True)

#: URL scheme -> backend: the one place a store URL is resolved.
BACKENDS: dict[str, Backend] = {
    "sqlite": Backend("a SQLite store", "sqlite:///", "logstore.backends.sqlite.target:parse_url",
                      "logstore.backends.sqlite.recorder:SQLiteRecorder"),
    "mysql": Backend("a MySQL/MariaDB store", "mysql://", "logstore.backends.mysql.target:parse_url",
                     "logstore.backends.mysql.recorder:MySQLRecorder", extra="mysql", replicas=True,
                     password=True),
    "http": _WORKER_NODE,
    "https": replace(_WORKER_NODE, prefix="https://"),
}


def load(where: str) -> Any:
    """The object a table entry names as ``module:name``, its module imported."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


def is_url(text: str) -> bool:
    """Whether a store target is a URL (else it is the path of a cluster file)."""
    scheme, colon, _ = text.partition(":")
    return "://" in text or (bool(colon) and scheme in BACKENDS)


def backend_of(url: str) -> Backend:
    """The backend of ``url`` by its scheme; InvalidArgumentError naming the known ones otherwise."""
    scheme = url.partition(":")[0]
    backend = BACKENDS.get(scheme)
    if backend is None:
        raise InvalidArgumentError(f"unsupported store URL scheme {scheme!r} (use {prefixes(lambda b: True)})")
    return backend


def prefixes(which: Callable[[Backend], bool]) -> str:
    """The URL prefixes of the backends ``which`` accepts, for messages: "sqlite:/// or mysql://"."""
    found = [b.prefix for b in BACKENDS.values() if which(b)]
    return " or ".join(found) if len(found) < 3 else f"{', '.join(found[:-1])} or {found[-1]}"


def parse_node_url(url: str) -> NodeTarget:
    """The target model of a store URL, by its backend; InvalidArgumentError when it does not parse."""
    return backend_of(url).parse(url)


def url_password(url: str) -> str | None:
    """The password in ``url``'s user part as written there (percent-encoded), None when it holds none or the URL
    does not parse."""
    try:
        userinfo, at, _ = urlsplit(url).netloc.rpartition("@")
    except ValueError:
        return None
    _, colon, password = userinfo.partition(":")
    return password if at and colon else None


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in its user part: a password kept apart from the URL (in a file or the
    environment, where other users of the machine cannot read it as they can a command line).

    Args:
        url: a store URL whose backend takes a password (``mysql://user@host/db``), holding none.
        password: the password, as is (it is percent-encoded here).

    Returns:
        The URL with the password, for :func:`logstore.open` or a cluster file's node.

    Raises:
        InvalidArgumentError: the URL does not parse, its backend takes no password, or it holds one already.
    """
    backend = backend_of(url)
    target = backend.parse(url)
    if not backend.password:
        raise InvalidArgumentError(f"{backend.what} takes no password (only a {prefixes(lambda b: b.password)} "
                                   "URL does)")
    if url_password(url) is not None:
        raise InvalidArgumentError(f"{target.redacted()} holds a password already: give it in one place")
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}").geturl()


def without_password(url: str) -> str:
    """``url`` with the password of its user part taken out (as is when it holds none): what may be recorded
    where others read it, such as the shard map every storage node keeps."""
    if url_password(url) is None:
        return url
    parts = urlsplit(url)
    userinfo, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{userinfo.partition(':')[0]}@{host}").geturl()
