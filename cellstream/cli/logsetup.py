"""Logging of the ``cellstream`` command: every line on stderr with its time and level, as text or as JSON lines
(``--log-format json``, env CELLSTREAM_LOG_FORMAT), for a log shipper to parse.

Commands log warnings and errors; the long-running ones (``tail``, ``run``, ``serve``, ``connect run``) log INFO
too, and begin with one line naming the version and their settings, secrets masked (:func:`starting`). ``-v``
logs INFO for every command. The worker processes of ``run --workers N`` log as their parent does, each line
naming its worker (:func:`configure_worker`). When the program running :func:`~cellstream.cli.main.main` has
configured logging itself (a test, an embedding app), its configuration is left alone.

The JSON formatter is a few lines over the standard library's ``logging.Formatter``: python-json-logger would be
a dependency for them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
from typing import Any

from logstore.build_info import version

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
logger = logging.getLogger("cellstream")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``{"time", "level", "logger", "worker"?, "message", "exception"?}``; the
    worker (``worker-0``, ...) in a worker process of ``cellstream run --workers N``."""

    def __init__(self, worker: str | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name}
        if self.worker is not None:
            doc["worker"] = self.worker
        doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure` installs (told apart from a program's own)."""


def configure(log_format: str, verbose: bool, *, worker: str | None = None) -> None:
    """Log to stderr as ``log_format`` (text or json), INFO too when ``verbose``, else warnings and errors;
    ``worker`` names the process in every line. Nothing changes when the program configured logging itself."""
    root = logging.getLogger()
    if any(not isinstance(h, _Handler) for h in root.handlers):
        return  # the program running main() logs as it chose
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _Handler(sys.stderr)
    text = TEXT if worker is None else TEXT.replace(" %(name)s", f" {worker} %(name)s")
    handler.setFormatter(JsonFormatter(worker) if log_format == "json" else logging.Formatter(text))
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def configure_worker(log_format: str, worker: str) -> None:
    """A worker process of ``cellstream run --workers N`` (spawned: it inherits no logging) logs as its
    parent, a long-running command, does: ``log_format``, INFO, each line naming ``worker``."""
    configure(log_format, True, worker=worker)


def starting(command: str, args: argparse.Namespace, **settings: Any) -> None:
    """A long-running command begins: log INFO from now on (when :func:`configure` set the level) and say
    what runs, with which settings: the command's options (the store's password masked) and ``settings``."""
    root = logging.getLogger()
    if any(isinstance(h, _Handler) for h in root.handlers):
        root.setLevel(min(root.level, logging.INFO))
    options = {k: _shown(k, v) for k, v in sorted(vars(args).items())
               if not callable(v) and k not in {"command", "action", "with_store", "creates_store", "verbose",
                                                "json", "log_format"}}
    logger.info("cellstream %s %s starting: %s", version(), command,
                json.dumps({**options, **settings}, default=str, sort_keys=True))


def _shown(name: str, value: Any) -> Any:
    if name == "store" and isinstance(value, str) and "://" in value:
        from logstore.config import parse_node_url
        from logstore.errors import InvalidArgumentError

        try:
            return parse_node_url(value).redacted()
        except InvalidArgumentError:
            return "(unparsable URL)"
    return value
