"""An app's handlers over a temporary embedded store: write cells, drain, check what came of them.

The harness runs the app the way ``cellstream run`` does in direct mode, through the same
processor: retries, dead letters and the stall threshold behave as in production. Only the
store (a new SQLite one in a temporary directory, 4096 shards unless told otherwise) and the
clock (a :class:`~indexer.testing.clock.FakeClock`: backoff costs no real time) are the test's.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import logstore
from indexer.errors import ConfigurationError
from indexer.runtime.app import App
from indexer.runtime.dlq_store import DeadLetter
from indexer.runtime.dlq_triage import DeadLetterQueue, DLQFilter
from indexer.runtime.handlers import Counts
from indexer.runtime.hooks import Hook
from indexer.testing.clock import FakeClock
from logstore import Cell, Store, TruncatedPage

_PAGE = 1000


class Retry(NamedTuple):
    """One failed attempt that the retry policy followed with another."""

    handler: str
    cells: tuple[Cell, ...]  # one cell, or a batch handler's batch
    attempt: int  # the attempt that failed (1 = the first)
    error: BaseException
    delay: float  # seconds of (fake) time before the next attempt


class _RetryLog(Hook):
    """Keeps the app's retries for the test (told on the event loop; the lock is for readers in other threads)."""

    def __init__(self) -> None:
        self.retries: list[Retry] = []
        self._lock = threading.Lock()

    def retrying(self, handler: str, cells: Sequence[Cell], attempt: int, error: BaseException,
                 delay: float) -> None:
        with self._lock:
            self.retries.append(Retry(handler, tuple(cells), attempt, error, delay))


class AppHarness:
    """Runs ``app`` over a temporary embedded store on a fake clock.

    ``app`` is an :class:`~indexer.App` (one built at import time, over whatever store: inside the
    harness it runs over the temporary one instead, which its handlers reach through their context or
    ``app.store``), or a function that builds the app over a given store (needed for an app that keeps
    indexes: they are built over their store). ``shards`` is the new store's shard count (default
    4096, as in production). Use it as a context manager, or close it: the app is given back as it was
    and the temporary store is deleted.
    """

    def __init__(self, app: App | Callable[[Store], App], *, shards: int | None = None,
                 clock: FakeClock | None = None) -> None:
        """Open the temporary store and put ``app`` over it.

        Args:
            app: the app, or a function that builds it over the store it is given.
            shards: the temporary store's shard count; None for 4096.
            clock: the app's clock; None for a new :class:`~indexer.testing.FakeClock`.

        Raises:
            ConfigurationError: the builder did not return an :class:`~indexer.App`, or the app cannot run over
                another store (it has handlers built over their destination: pass a builder) or is serving.
        """
        self.clock = clock or FakeClock()
        self._directory = tempfile.TemporaryDirectory(prefix="cellstream-harness-")
        self.directory = Path(self._directory.name)
        """The temporary directory holding the store; :meth:`close` deletes it."""
        self._log = _RetryLog()
        self._mine: set[tuple[uuid.UUID, str, int]] = set()
        self._stack = contextlib.ExitStack()
        try:
            self.store = self._stack.enter_context(logstore.open(f"sqlite:///{self.directory / 'store'}",
                                                                 shards))
            if isinstance(app, App):
                target = app
            else:
                target = app(self.store)
                if not isinstance(target, App):
                    raise ConfigurationError(f"the app builder returned {type(target).__name__}, not an indexer.App")
                self._stack.callback(target.close)  # the harness made it: the harness closes it
            self.app = self._stack.enter_context(target.substituted(self.store, self.clock, [self._log]))
        except BaseException:
            self.close()
            raise

    # -- cells in -----------------------------------------------------------------
    def write(self, column: str, body: dict[str, Any], *, row_key: uuid.UUID | str | None = None,
              ref_key: int | None = None) -> Cell:
        """Write a cell as a producer would.

        Args:
            column: the cell's column.
            body: the cell's body (JSON-like).
            row_key: the row; None for a new one.
            ref_key: the version; None for the next of the row's column.

        Returns:
            The cell as stored.

        Raises:
            InvalidCellError: a bad column, row key, ref_key or body (the store's typed errors).
            CellConflictError: the row's column has that ref_key already, with another body.
        """
        key = row_key if row_key is not None else uuid.uuid4()  # the store checks a given one (a typed error)
        if ref_key is None:
            latest = self.store.get_cell_latest(key, column)
            ref_key = latest.ref_key + 1 if latest is not None else 1
        cell = self.store.put_cell(key, column, ref_key, body)
        self._mine.add((cell.row_key, cell.column, cell.ref_key))
        return cell

    # -- running --------------------------------------------------------------------
    def drain(self, timeout: float = 60) -> Counts:
        """Run the handlers over every cell not handled yet (the cells they write included), then stop.

        Args:
            timeout: seconds to reach the end before giving up.

        Returns:
            What this drain processed, retried and dead-lettered.

        Raises:
            HandlerStalledError, DrainTimeoutError: as :meth:`App.drain <indexer.App.drain>`.
        """
        return self.app.drain(timeout)

    async def drain_async(self, timeout: float = 60) -> Counts:
        """:meth:`drain` for a test already running an event loop."""
        return await self.app.drain_async(timeout)

    # -- what came of it ----------------------------------------------------------------
    @property
    def retries(self) -> list[Retry]:
        """Every failed attempt that was retried, in the order they happened."""
        with self._log._lock:
            return list(self._log.retries)

    @property
    def dlq(self) -> DeadLetterQueue:
        """The app's dead-letter queue (list, show, replay, discard), over the harness's store."""
        return self.app.dlq

    def dead_letters(self, match: DLQFilter | None = None, **filters: Any) -> list[DeadLetter]:
        """The app's dead-letter entries, oldest first.

        Args:
            match: a filter; or give its fields as ``filters``.
            **filters: handler=, status=, error=, fingerprint=, text=, since=, until= (see
                :class:`~indexer.DLQFilter`).

        Returns:
            The latest version of each matching entry.

        Raises:
            InvalidFilterError: an unknown filter field or a bad value.
        """
        return self.dlq.list(match, **filters)

    def cell(self, row_key: uuid.UUID | str, column: str, ref_key: int | None = None) -> Cell | None:
        """One cell of the store.

        Args:
            row_key: the row.
            column: the column.
            ref_key: the version; None for the latest.

        Returns:
            The cell, or None if there is none.
        """
        if ref_key is None:
            return self.store.get_cell_latest(row_key, column)
        return self.store.get_cell(row_key, column, ref_key)

    def row(self, row_key: uuid.UUID | str) -> dict[str, Cell]:
        """The latest cell of each column of the row ``row_key`` (column -> cell; empty when there is none)."""
        return self.store.get_row(row_key)

    def cells(self, column: str | None = None) -> list[Cell]:
        """Every cell in the store, shard after shard in log order; cellstream's own cells (offsets, dead
        letters: columns starting with ``_``) left out.

        Args:
            column: only this column's cells; None for every column.

        Returns:
            The cells, by shard and added_id.
        """
        columns = None if column is None else [column]
        locations = dict.fromkeys(range(self.store.shard_count), 0)
        found: list[Cell] = []
        while locations:
            pages = self.store.get_cells_for_shards(locations, _PAGE, columns=columns)
            following: dict[int, int] = {}
            for shard in sorted(pages):
                page = pages[shard]
                if isinstance(page, Exception):
                    raise page
                found.extend(cell for cell in page if not cell.column.startswith("_"))
                if page and (len(page) == _PAGE or isinstance(page, TruncatedPage)):
                    following[shard] = page[-1].added_id
            locations = following
        return sorted(found, key=lambda c: (c.shard, c.added_id))

    def written(self, column: str | None = None) -> list[Cell]:
        """The cells the handlers wrote: every cell of :meth:`cells` (of ``column``, if given) that the test
        did not :meth:`write`."""
        return [cell for cell in self.cells(column) if (cell.row_key, cell.column, cell.ref_key) not in self._mine]

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Give the app back as it was, close the store, delete it. Safe twice."""
        try:
            self._stack.close()
        finally:
            self._directory.cleanup()

    def __enter__(self) -> AppHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AppHarness(app={self.app.name!r}, store={self.store!r})" if hasattr(self, "app") else "AppHarness()"
