"""Logging of the ``cellstream`` command: every line on stderr with its time and level, as text or as JSON lines
(``--log-format json``, env CELLSTREAM_LOG_FORMAT), for a log shipper to parse.

Commands log warnings and errors; the long-running ones (``tail``, ``run``, ``serve``, ``connect run``) log INFO
too, and begin with one line naming the version and their settings, secrets masked (:func:`starting`). ``-v``
logs INFO for every command. The worker processes of ``run --workers N`` log as their parent does, each line
naming its worker (:func:`configure_worker`). When the program running :func:`~cellstream.cli.main.main` has
configured logging itself (a test, an embedding app), its configuration is left alone.

The JSON formatter is a few lines over the standard library's ``logging.Formatter``: python-json-logger would be
a dependency for them.

Data cannot forge a log record. A text record is one line at column 0; its message shows its control characters
escaped (``\\n``, ``\\x1b``, tabs kept), and every line of its traceback is indented, so a newline inside an
exception message (one quoting cell data, say) cannot start a line that reads as a record
(:class:`TextFormatter`). A JSON record is one line by JSON's escaping.
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

# The characters that could end a text record's line or rewrite it on a terminal, as escapes: C0 but tab, DEL, C1,
# and the line and paragraph separators (str.splitlines breaks at those too).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c != 0x09}
_CONTROLS.update({0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})
# JSON escapes C0 itself; the rest of those, left raw by ensure_ascii=False, are written as JSON escapes.
_JSON_CONTROLS = {c: f"\\u{c:04x}" for c in (0x7F, *range(0x80, 0xA0), 0x2028, 0x2029)}
# Every line of a record after its first begins with this: a line at column 0 always starts a record.
CONTINUATION = "  "


def escape_controls(text: str) -> str:
    """``text`` with its control characters (but tab) and line separators written as escapes: one line."""
    return text.translate(_CONTROLS)


class TextFormatter(logging.Formatter):
    """``logging.Formatter`` whose records data cannot forge: the first line (the message) with its control
    characters escaped, the traceback and stack after it each line indented by :data:`CONTINUATION` and escaped.

    A traceback's own line breaks are its structure and stay (a multi-line exception message, as pydantic's, stays
    readable), but none of its lines starts at column 0, where a record starts: readers that group the lines of a
    record that way (``less``, ``grep -A``, log shippers' multi-line rules) cannot be shown a forged one.
    """

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = escape_controls(self.formatMessage(record))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        # exc_text may be another formatter's, cached on the record: escaped here, never in the cache.
        for block in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if block:
                text += "".join(f"\n{CONTINUATION}{escape_controls(line)}" for line in block.split("\n"))
        return text


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
        return json.dumps(doc, ensure_ascii=False, default=str).translate(_JSON_CONTROLS)


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
    handler.setFormatter(JsonFormatter(worker) if log_format == "json" else TextFormatter(text))
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
