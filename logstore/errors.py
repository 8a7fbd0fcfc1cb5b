"""The logstore error hierarchy.

Every error raised by logstore is a :class:`LogstoreError`, itself a
:class:`CellstreamError`, the root of every error of the project. Callers decide on
retries with the ``retriable`` flag rather than by class: a retriable error means
"the same call may succeed later, and repeating it is safe" (puts are idempotent).
Driver errors (pymysql, sqlite3) are translated at one boundary per backend and
never escape untranslated.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any


class CellstreamError(Exception):
    """Root of every error cellstream raises, in every package (logstore, tailer, indexer, connectors, the CLI).

    ``retriable`` is a class attribute: True means the same call may succeed later
    and repeating it is safe. Each package's root subclasses this one.
    """

    retriable: bool = False


class LogstoreError(CellstreamError):
    """Root of every logstore error."""


class InvalidArgumentError(LogstoreError, ValueError):
    """An argument is malformed (shard out of range, naive datetime, bad URL...)."""


class InvalidCellError(InvalidArgumentError):
    """A cell's coordinates or body are invalid; ``field`` names the bad part.

    ``field`` is ``row_key``, ``column``, ``ref_key`` or ``body`` followed by a
    path into the body, e.g. ``body.items[3].price``; ``index`` is the cell's place in
    a batch (``put_cells``), None for a single cell.
    """

    def __init__(self, field: str, problem: str, index: int | None = None) -> None:
        self.field = field
        self.problem = problem
        self.index = index
        where = "" if index is None else f" (cell #{index})"
        super().__init__(f"invalid cell {field}: {problem}{where}")


class CellConflictError(LogstoreError):
    """A cell already exists at these coordinates with a different body.

    Cells are immutable: nothing was written. Write a higher ref_key instead.
    """

    def __init__(self, row_key: object, column: str, ref_key: int) -> None:
        self.row_key = row_key
        self.column = column
        self.ref_key = ref_key
        super().__init__(
            f"cell ({row_key}, {column}, {ref_key}) already exists with a different body; "
            "cells are immutable, write a higher ref_key"
        )


class ConfigurationError(LogstoreError):
    """Options, a file or what they point at do not fit: a store's shard count, cluster map or credentials, a
    topic's partition count, an app's handlers, a connector's file or sink root.

    One class for the whole project, defined here in the lowest layer so that every package raises the same
    one (the tailer, the indexer and the connectors re-export it from their ``errors``); a caller catches one
    name whichever part found the problem. Never retriable: the same call fails until the setting changes.
    """


class ConfigFileError(ConfigurationError):
    """A configuration file (an index definition file, a connector file) cannot be read or does not validate.

    ``source`` is the file's path (or a label such as ``<indexes>`` for text), ``line`` the 1-based line of the
    problem (None when unknown), ``field`` its dotted field ("" for the file as a whole), ``problem`` what is
    wrong; the message holds all of them on one line: ``indexes.yaml:7: indexes[trips].column: ...``.
    """

    def __init__(self, source: str, line: int | None, field: str, problem: str) -> None:
        self.source, self.line, self.field = source, line, field
        self.problem = " ".join(problem.split())  # one line whatever the parser said
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {field}: {self.problem}" if field else f"{where}: {self.problem}")


class StoreNotFoundError(ConfigurationError):
    """A store was opened for reading (``create=False``) where there is none: no SQLite file, no MySQL database,
    or one without cellstream's tables. Nothing was created."""


class AuthenticationError(ConfigurationError):
    """A server refused the credentials cellstream gave it (MySQL/MariaDB, PostgreSQL, Kafka SASL,
    ZooKeeper digest). The message names the server and the user, never the secret."""


class MissingExtraError(ConfigurationError):
    """An optional part was asked for but the package behind it is not installed; ``extra`` names the
    cellstream extra that brings it (``pip install 'cellstream[EXTRA]'``)."""

    def __init__(self, extra: str, module: str, what: str) -> None:
        self.extra = extra
        self.module = module
        super().__init__(f"{what} needs cellstream[{extra}] ({module} is not installed): "
                         f"pip install 'cellstream[{extra}]'")


class StorageError(LogstoreError):
    """The storage backend failed in a way that repeating the call will not fix."""


class StorageUnavailableError(StorageError):
    """A storage node cannot be reached or timed out. Retriable: the call is safe to repeat."""

    retriable = True


class ShardMovedError(StorageError):
    """The shard was moved to another storage node (``cellstream shards move``): the store reloads its
    map and sends the call there, so callers only see this when the map cannot be reloaded. Retriable."""

    retriable = True

    def __init__(self, shard: int, node: str) -> None:
        self.shard = shard
        self.node = node
        super().__init__(f"shard {shard} moved to storage node {node}")


class NodeDownError(StorageUnavailableError):
    """A job's throttle found a storage node that its chunks touch down (:mod:`logstore.jobs.load`): waiting
    would not help. The kind decides (a rebalance skips the moves touching ``node``); let through, the runner
    retries the step. Retriable."""

    def __init__(self, node: str, detail: str) -> None:
        self.node = node
        super().__init__(detail)


class CorruptCellError(StorageError):
    """A stored cell body cannot be decoded (unknown format version or damaged bytes).

    Raised by a read of a stored cell, the error names it: ``shard``, ``added_id``,
    ``row_key``, ``column``, ``ref_key`` and ``created_at`` (None when unknown). A log
    read also carries ``cells_before``, the good cells of the page that precede the
    damaged one, so a tailer can deliver them, dead-letter this one and go on from
    its ``added_id`` without skipping anything.
    """

    def __init__(self, problem: str, coordinates: dict[str, Any] | None = None) -> None:
        where = coordinates or {}
        self.problem = problem
        self.shard: int | None = where.get("shard")
        self.added_id: int | None = where.get("added_id")
        self.row_key: uuid.UUID | None = where.get("row_key")
        self.column: str | None = where.get("column")
        self.ref_key: int | None = where.get("ref_key")
        self.created_at: dt.datetime | None = where.get("created_at")
        self.cells_before: list[Any] = []
        named = (f"cell ({self.row_key}, {self.column}, {self.ref_key}) at shard {self.shard} "
                 f"added_id {self.added_id}: ") if coordinates else ""
        super().__init__(named + problem)


class JobError(LogstoreError):
    """Root of the errors of the job machinery (:mod:`logstore.jobs`): a job's record, its state or its kind."""


class JobNotFoundError(JobError):
    """No job has this id in the store (``cellstream jobs list --all`` lists them)."""


class JobStateError(JobError):
    """The job is in a state that does not allow the change asked for (resume a job that is done, run a job
    another live process owns...); the message names the state and what would be allowed."""


class JobLeaseLostError(JobStateError):
    """The runner no longer holds the job's lease (its renewal failed for longer than the lease, and another
    runner may have taken the job over): it stopped without writing, and the job goes on elsewhere."""


class UnknownJobKindError(ConfigurationError):
    """The job's kind is not in the registry of this process (a job made by a newer cellstream, or a kind whose
    package is not installed): nothing was run."""


class BackupError(LogstoreError):
    """Root of the errors of backups and restores (:mod:`logstore.backup`)."""


class BackupNotFoundError(BackupError):
    """No backup (or no file of one) by that name at the destination; the message names what was looked for."""


class CorruptBlockError(LogstoreError, ValueError):
    """Bytes that are not a log block (:mod:`logstore.log_blocks`); the message names the offset where they
    stop reading as one, and whoever read them names where they came from."""


class CorruptBackupError(BackupError):
    """A backup file is missing, truncated or does not match its checksum: ``name`` names it. A restore refuses
    the whole backup before writing anything."""

    def __init__(self, name: str, problem: str) -> None:
        self.name = name
        self.problem = problem
        super().__init__(f"backup file {name}: {problem}")


class PromotionError(StorageError):
    """A replica could not be made its node's primary (its replication failed, or it did not catch up in the
    time given): nothing was switched, and the message says what the replica reported."""


class RestoreTargetNotEmptyError(BackupError):
    """A restore's target holds cells in the shards to restore (or consumer offsets): a restore writes the
    backup's added_ids, which only an empty instance can take. Nothing was written."""


class ReadOnlyStoreError(ConfigurationError):
    """The store is a standby mirror of another instance (``cellstream mirror run``): only the mirror writes to
    it until ``cellstream mirror promote`` makes it writable. Nothing was written."""


class InvalidConditionError(InvalidArgumentError):
    """A query condition an index cannot take (``logstore.index_tables.query``): ``field`` is the condition's
    key as given (``where.<key>`` over HTTP), ``problem`` what is wrong with it."""

    def __init__(self, message: str, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(message)


class IndexUnknownError(LogstoreError):
    """No index of that name in the index catalog, or no such version of it (a worker node answers 404)."""


class IndexInactiveError(LogstoreError):
    """The index has no active version yet: a query must name one (a worker node answers 409)."""
