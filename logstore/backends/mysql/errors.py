"""MySQL driver errors as logstore's: the one place pymysql's errors are translated."""

from __future__ import annotations

import ssl

import pymysql

from logstore.errors import (
    AuthenticationError,
    ConfigurationError,
    LogstoreError,
    ShardMovedError,
    StorageError,
    StorageUnavailableError,
    StoreNotFoundError,
)

# Connection lost, server gone or shutting down, network read/write errors, lock wait
# timeout, deadlock, too many connections, query interrupted, connection killed or
# idle-disconnected: the same call may succeed later.
UNAVAILABLE = {1040, 1053, 1158, 1159, 1160, 1161, 1205, 1213, 1317, 1927, 2002, 2003, 2006, 2013,
               2014, 2055, 4031}
BAD_CONFIG = {1044, 1045, 1049, 1142, 1227}
ACCESS_DENIED = 1045  # a wrong user or password, or a user that must connect with TLS
UNKNOWN_DATABASE = 1049
SSL_REQUIRED_UNSUPPORTED = 2026  # pymysql: TLS required but the server offers none
NO_TABLE = 1146
DUPLICATE = 1062
DUPLICATE_COLUMN = 1060
BAD_FIELD = 1054  # an unknown column (a replica behind a column's creation)
NULL_COLUMN = 1048  # a NULL into a NOT NULL column: a one-shard write that found no counter to take ids from


def code(exc: pymysql.Error) -> int | None:
    return exc.args[0] if exc.args and isinstance(exc.args[0], int) else None


def translate(exc: pymysql.Error, node: str) -> LogstoreError:
    number = code(exc)
    message = exc.args[1] if len(exc.args) > 1 else str(exc)
    text = f"storage node {node}: MySQL error {number}: {message}"
    if number == SSL_REQUIRED_UNSUPPORTED or isinstance(exc.__context__, ssl.SSLCertVerificationError):
        # A refused certificate or a server without TLS: the same connection fails until the URL's ssl_* change.
        return ConfigurationError(f"{text} (TLS: check the URL's ssl_mode, ssl_ca, ssl_cert and ssl_key)")
    if number in UNAVAILABLE or isinstance(exc, pymysql.err.InterfaceError):
        return StorageUnavailableError(text)
    if number == UNKNOWN_DATABASE:
        return StoreNotFoundError(f"no store at storage node {node}: {message}")
    if number == ACCESS_DENIED:
        return AuthenticationError(text)
    if number in BAD_CONFIG:
        return ConfigurationError(text)
    return StorageError(text)


def retry_here(exc: BaseException) -> bool:
    # A moved shard is retriable for the store, which sends the call elsewhere: not against this node.
    return bool(getattr(exc, "retriable", False)) and not isinstance(exc, ShardMovedError)
