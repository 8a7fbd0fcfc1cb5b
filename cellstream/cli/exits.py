"""The exit codes of every ``cellstream`` command: one table for all of them (also in the README)."""

from __future__ import annotations

import sys
from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    NOT_FOUND = 1  # no such cell, index or version
    USAGE = 2  # bad input or usage, told in one line
    CONFLICT = 3  # the cell exists with another body
    CONFIG = 4  # a configuration problem: store, app, cluster or connector file
    UNAVAILABLE = 5  # a server (storage, Kafka, ZooKeeper, a sink) unavailable: retry later
    FAILED = 6  # another storage, publishing or sink failure
    STALLED = 7  # a handler stalled: too many open dead letters
    MISMATCH = 8  # index verify found mismatches and did not repair them all
    STATE = 9  # an index version in the wrong state for the command
    INTERRUPTED = 130


def fail(exc: BaseException, code: Exit) -> int:
    """Report ``exc`` in one line on stderr; return ``code``."""
    print(f"cellstream: error: {exc}", file=sys.stderr)
    return code
