"""The exit codes of every ``cellstream`` command and the one table that maps an error to its code.

Commands raise; :func:`cellstream.cli.main.main` reports the error in one line and exits with
:func:`exit_code` of it. The table's modules are imported when an error is mapped, never at start-up.
Two codes are no error of a command: INTERRUPTED (Ctrl-C) and BROKEN_PIPE (the reader of stdout closed it),
which ``main`` returns without a message.
"""

from __future__ import annotations

import sys
from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    NOT_FOUND = 1  # no such cell, dead letter, index or version, job, consumer
    USAGE = 2  # bad input or usage, told in one line
    CONFLICT = 3  # the cell exists with another body
    CONFIG = 4  # a configuration problem: store, app, cluster, index or connector file; a missing extra
    UNAVAILABLE = 5  # a server (storage, Kafka, ZooKeeper, a sink) unavailable: retry later
    FAILED = 6  # another storage, publishing or sink failure
    STALLED = 7  # a handler stalled: too many open dead letters; a migration's capture lags over --max-lag
    MISMATCH = 8  # index verify found mismatches and did not repair them all; a migration diff found differences
    STATE = 9  # an index version, a job or a migration in the wrong state; a consumer running (offsets reset)
    INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
    BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away (`cellstream log 1 | head`); nothing printed


def exit_code(exc: BaseException) -> Exit:
    """The exit code of an error: the first class of the table it is an instance of; any other
    cellstream error is UNAVAILABLE when retriable, else FAILED."""
    from cellstream.errors import UsageError
    from connectors import errors as connectors
    from indexer import errors as indexer
    from logstore import errors as logstore
    from tailer import errors as tailer

    table: tuple[tuple[tuple[type[BaseException], ...], Exit], ...] = (
        ((UsageError, logstore.InvalidArgumentError, indexer.InvalidFilterError, indexer.InvalidQueryError),
         Exit.USAGE),
        ((indexer.EntryNotFoundError, indexer.IndexNotFoundError, logstore.JobNotFoundError,
          tailer.ConsumerNotFoundError), Exit.NOT_FOUND),
        ((logstore.CellConflictError,), Exit.CONFLICT),
        ((logstore.ConfigurationError,), Exit.CONFIG),  # ConfigFileError (an index or connector file) too
        ((connectors.MigrationSourceUnavailableError,), Exit.UNAVAILABLE),
        ((connectors.MigrationSourceError,), Exit.CONFIG),  # a source not set up for a migration: the message says how
        ((indexer.HandlerStalledError,), Exit.STALLED),
        ((indexer.IndexStateError, logstore.JobStateError, connectors.MigrationStateError,
          tailer.ConsumerRunningError), Exit.STATE),
        # Input files (--batch, --token-file): a path that cannot be read, or text that is not UTF-8.
        ((OSError, UnicodeDecodeError), Exit.USAGE),
    )
    for kinds, code in table:
        if isinstance(exc, kinds):
            return code
    if isinstance(exc, logstore.CellstreamError):
        return Exit.UNAVAILABLE if exc.retriable else Exit.FAILED
    raise exc


def fail(exc: BaseException) -> int:
    """Report ``exc`` in one line on stderr; return its code from the table."""
    if isinstance(exc, UnicodeDecodeError):
        message = f"input is not UTF-8 text ({exc.reason} at byte {exc.start})"
    else:
        message = str(exc)
    print(f"cellstream: error: {message}", file=sys.stderr)
    return exit_code(exc)
