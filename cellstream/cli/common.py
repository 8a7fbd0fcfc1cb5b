"""What every command module shares: the parser class, the common options, output, argument types.

Nothing here imports logstore, the runtime or a driver: ``cellstream --help`` and
``--version`` build every parser, and must stay fast (a command imports what it
needs when it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import logging
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from cellstream.errors import UsageError
from indexer.runtime import collector

if TYPE_CHECKING:
    from pydantic import SecretStr, ValidationError

    from logstore import Cell
    from tailer.security import KafkaSecurity


logger = logging.getLogger(__name__)

# The garbage collector's thresholds for a process that streams cells (cellstream tail, cellstream run): App.run
# and App.drain use them while they run (indexer/runtime/collector.py says why).
STREAMING_GC_THRESHOLDS = collector.STREAMING_GC_THRESHOLDS


# The interpreter's switch interval for that process (Python's default is 5 ms): the event loop does most of
# the work, fed by threads that read pages, and gets the GIL back sooner after lending it to them.
STREAMING_SWITCH_INTERVAL = 0.0005


def tune_for_streaming() -> None:
    """Set :data:`STREAMING_GC_THRESHOLDS` and :data:`STREAMING_SWITCH_INTERVAL`, and freeze what start-up
    allocated (modules, configuration: a full collection then walks only what the loop made). For the
    process's owner (a command), never for a library's caller."""
    gc.set_threshold(*STREAMING_GC_THRESHOLDS)
    sys.setswitchinterval(STREAMING_SWITCH_INTERVAL)
    gc.freeze()


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are a :class:`UsageError` (one line, exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        # "cellstream: error: " prefixes every error once; the command's name (prog minus "cellstream") says where.
        where = self.prog.removeprefix("cellstream").strip()
        raise UsageError(f"{where}: {message}" if where else message)


def common_options(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options every command takes: --store, --json, --verbose, --log-format.

    Given before the command they go on the top-level ``parser`` (with their defaults); after it, on every
    command's parser, whose copies default to SUPPRESS so that not repeating one there keeps what was given
    before. ``cellstream --json get ...`` and ``cellstream get ... --json`` mean the same.
    """
    common = parser or Parser(add_help=False)
    top = parser is not None
    common.add_argument("--store", default=os.environ.get("CELLSTREAM_STORE") if top else argparse.SUPPRESS,
                        help="sqlite:///dir, mysql://user:pw@host:port/db, a cluster file or a worker node's "
                        "http://host:port (env CELLSTREAM_STORE; a worker node's token: env CELLSTREAM_TOKEN)")
    common.add_argument("--store-password-file", type=Path, metavar="FILE",
                        default=None if top else argparse.SUPPRESS,
                        help="file holding the password of a mysql:// --store given without one, kept off the "
                             "command line where other users see it (env CELLSTREAM_STORE_PASSWORD)")
    common.add_argument("--json", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="print JSON (JSON lines for streams)")
    common.add_argument("-v", "--verbose", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="log INFO too (long-running commands always do)")
    common.add_argument("--log-format", choices=["text", "json"],
                        default=os.environ.get("CELLSTREAM_LOG_FORMAT", "text") if top else argparse.SUPPRESS,
                        help="log lines on stderr as text or JSON objects, each with its time and level "
                             "(env CELLSTREAM_LOG_FORMAT)")
    return common


def add_kafka_config(parser: argparse.ArgumentParser) -> None:
    """``--kafka-config FILE``: TLS and SASL for Kafka, as Kafka client properties (see docs/security.md)."""
    parser.add_argument("--kafka-config", metavar="FILE", default=None,
                        help="Kafka client properties (security.protocol, sasl.*, ssl.*), one key=value per line "
                             "(env CELLSTREAM_KAFKA_CONFIG)")


def add_zookeeper_auth(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zookeeper-auth-file", metavar="FILE", default=None,
                        help="file holding user:password for ZooKeeper's digest authentication; the nodes "
                             "cellstream creates get an ACL for that user alone (env CELLSTREAM_ZOOKEEPER_AUTH)")


def zookeeper_auth(path: str | None) -> SecretStr | None:
    """The ZooKeeper credentials of ``--zookeeper-auth-file``, else of CELLSTREAM_ZOOKEEPER_AUTH, else None."""
    from pydantic import SecretStr

    from logstore.errors import ConfigurationError
    from tailer.config import check_zookeeper_auth

    where = f"--zookeeper-auth-file {path}" if path else "CELLSTREAM_ZOOKEEPER_AUTH"
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"{where}: cannot be read ({type(exc).__name__})") from None
    else:
        value = os.environ.get("CELLSTREAM_ZOOKEEPER_AUTH", "")
        if not value:
            return None
    try:
        return SecretStr(check_zookeeper_auth(value))
    except ValueError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None


def kafka_override(path: str | None, brokers: str | None, what: str) -> KafkaSecurity | None:
    """The TLS and SASL settings that replace those of ``what`` (an app or connector whose ``brokers`` are
    given): from ``--kafka-config``, else from CELLSTREAM_KAFKA_CONFIG; None to keep its own. The option
    given for something that does not read Kafka is refused."""
    from logstore.errors import ConfigurationError

    if path is not None and brokers is None:
        raise ConfigurationError(f"--kafka-config: {what} reads the logstore, not Kafka (it has no brokers)")
    path = path or os.environ.get("CELLSTREAM_KAFKA_CONFIG") or None
    if brokers is None or path is None:
        return None
    from tailer.security import load_kafka_config

    return load_kafka_config(path)


class Output:
    """Writes results as human lines or, with --json, as JSON (one document or JSON lines)."""

    def __init__(self, as_json: bool, out: TextIO) -> None:
        self.as_json = as_json
        self.out = out

    def emit(self, data: Any, human: str) -> None:
        print(json.dumps(data, ensure_ascii=False) if self.as_json else human, file=self.out, flush=True)

    def cell(self, cell: Cell) -> None:
        self.emit(cell.to_json(), human_cell(cell))


def human_cell(cell: Cell) -> str:
    when = cell.created_at.isoformat(timespec="microseconds").replace("+00:00", "Z")
    body = json.dumps(cell.body, ensure_ascii=False, separators=(",", ":"))
    return f"shard={cell.shard} added_id={cell.added_id} {when} {cell.row_key} {cell.column}@{cell.ref_key} {body}"


def json_arg(text: str, what: str) -> Any:
    """``text`` parsed as JSON, or a UsageError naming ``what`` (NaN and Infinity are not JSON)."""
    def refuse(constant: str) -> Any:
        raise UsageError(f"{what} is not valid JSON: {constant} is not a JSON number")
    try:
        return json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise UsageError(f"{what} is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        raise UsageError(f"{what} is not valid JSON: {exc}") from None


def poll_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--poll {text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"--poll must be a positive number of seconds, got {text}")
    return value


def time_arg(text: str, option: str = "--since") -> dt.datetime:
    """A time option's value: ISO 8601, UTC when it gives no offset."""
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{option} {text!r} is not an ISO-8601 time, e.g. 2026-01-31T12:00:00Z") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def columns_arg(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))


def parse_bind(text: str) -> tuple[str, int]:
    """``--bind HOST:PORT`` of a command that listens (``[::1]:8080`` for IPv6)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise UsageError(f"--bind {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def read_token(file: Path | None, option: str, variable: str) -> str | None:
    """A secret from a file (``option``) or the environment (``variable``), never from the command line,
    where other users of the machine could read it."""
    if file is not None:
        try:
            token = file.read_text().strip()
        except OSError as exc:
            raise UsageError(f"{option} {file}: {exc.strerror}") from None
        if not token:
            raise UsageError(f"{option} {file} is empty")
        return str(token)
    return os.environ.get(variable) or None


def strong_token(file: Path | None, option: str, variable: str) -> str | None:
    """:func:`read_token`, refused in one line naming where it came from when it is too weak to be a token."""
    from logstore.node.guard import check_token

    token = read_token(file, option, variable)
    if token is not None:
        where = f"{option} {file}" if file is not None else variable
        try:
            check_token(token, f"the token in {where}")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return token


def store_with_password(store: str | None, file: Path | None, argv: Sequence[str]) -> str | None:
    """``--store`` (or CELLSTREAM_STORE) with its password filled in, and a warning when it is on the command line.

    The password of a ``mysql://`` URL given without one comes from ``--store-password-file`` (``file``), else
    from CELLSTREAM_STORE_PASSWORD. A URL whose password is in ``argv`` (the process's own command line, which
    every user of the machine can read with ``ps``) still works, with a warning that names these ways instead.

    Args:
        store: the store as given: a URL, a cluster file's path, or None.
        file: ``--store-password-file``.
        argv: the process's command line (``sys.argv``).

    Returns:
        The store, its URL holding the password when one was given apart.

    Raises:
        UsageError: ``--store-password-file`` cannot be read or is empty, or is given with a store that takes
            no password from it (not a URL, not ``mysql://``, or one that holds a password already).
    """
    from logstore.errors import InvalidArgumentError
    from logstore.registry import BACKENDS, is_url, url_password, with_password

    url = store if store is not None and is_url(store) else None
    written = url_password(url) if url is not None else None
    if url is not None and written and any(url in arg for arg in argv[1:]):
        logger.warning("the --store URL holds a password, which every user of this machine can read on the command "
                       "line (ps); give it in a file (--store-password-file FILE) or the environment "
                       "(CELLSTREAM_STORE_PASSWORD), or the whole URL in CELLSTREAM_STORE")
    password = read_token(file, "--store-password-file", "CELLSTREAM_STORE_PASSWORD")
    if password is None or store is None:
        return store
    if file is None:
        # The environment's password goes to a URL that needs one, and is no error beside another store.
        backend = BACKENDS.get(store.partition(":")[0]) if url is not None else None
        return store if backend is None or not backend.password or written is not None else with_password(
            store, password)
    if url is None:
        raise UsageError(f"--store-password-file is for a mysql:// --store URL; {store} is a cluster file, whose "
                         "nodes name their own (password_file or password_env)")
    try:
        return with_password(url, password)
    except InvalidArgumentError as exc:
        raise UsageError(f"--store-password-file {file}: {exc}") from None


def option_problem(exc: ValidationError) -> str:
    """A configuration model's first refusal as one line naming the option: ``--tls-key: ...``."""
    error = exc.errors()[0]
    problem = str(error["msg"]).removeprefix("Value error, ")
    if error["loc"]:
        problem = "--" + "-".join(str(p) for p in error["loc"]).replace("_", "-") + ": " + problem
    return problem


@contextlib.asynccontextmanager
async def stop_signals() -> AsyncIterator[asyncio.Event]:
    """An event SIGTERM and SIGINT set, for a serving command (serve, console) to wait on. Entered before the
    server starts: a signal sent as soon as its URL is printed must stop it cleanly, not kill it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(sig)

