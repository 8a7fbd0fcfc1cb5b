"""Secondary indexes in the runtime: keeping a version current from the cell stream, and querying.

>>> app.index("indexes.yaml")                                                  # doctest: +SKIP
>>> Index(store, "driver_partner_index").query(
...     driver_partner_uuid=driver, city_uuid=city, trip_created_at=(start, end), limit=50)  # doctest: +SKIP

An app that registers an index keeps every maintained version of it current
(:class:`IndexApplier`): the cells of a batch are turned into entries, a cell whose
body does not fit the definition is dead-lettered with the reason (a tombstone, whose
row has no value from that version on, removes the row's entry), and the rest are
applied in one transaction per storage node that also records the batch's source
position (so a restart neither skips nor applies a cell twice). Applying is
idempotent and order-insensitive (see :mod:`logstore.index_tables.persistence`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from types import EllipsisType
from typing import Any

from indexer.errors import IndexNotFoundError, IndexStateError, InvalidQueryError
from indexer.indexes.catalog import IndexCatalog, IndexRecord
from indexer.indexes.definitions import IndexDefinition
from logstore import Cell, CorruptCellError, InvalidArgumentError, LogstoreError, Store
from logstore.cell import is_tombstone
from logstore.errors import IndexInactiveError, IndexUnknownError, InvalidConditionError
from logstore.index_tables.persistence import ApplyResult, Condition, IndexChange, IndexEntry, Stream
from logstore.index_tables.query import conditions
from logstore.index_tables.store import MAX_QUERY_LIMIT

logger = logging.getLogger(__name__)
_REFRESH = 1.0  # seconds a query reuses the catalog record (which version is active)


def change_of(definition: IndexDefinition, cell: Cell) -> IndexChange:
    """The change a cell makes to an index version: its entry, or with ``values`` None the removal of its row's
    entry when the cell is a tombstone (:func:`logstore.cell.is_tombstone`), which never fails.

    Raises:
        EntryFieldError: the body is not a tombstone and does not fit the definition.
    """
    values = None if is_tombstone(cell.body) else definition.entry(cell.body)
    return IndexChange(cell.shard, cell.added_id, cell.row_key, cell.ref_key, values)


def handler_name(definition: IndexDefinition) -> str:
    """The handler name of an index version in an app (its dead letters carry it)."""
    return f"index:{definition.name}.v{definition.version}"


class IndexApplier:
    """Keeps one index version current: the app's batch handler for the version's source column."""

    def __init__(self, store: Store, definition: IndexDefinition) -> None:
        self.store = store
        self.definition = definition
        self.spec = definition.spec
        self.name = handler_name(definition)
        self.dropped = False
        self.result = ApplyResult()
        # Applies of different shards at once: a server's commits overlap, an embedded database has one writer.
        self.calls_at_once = store.parallel_writes
        # The stream whose positions a batch moves: None in a replay (indexer.runtime.replay), whose range may
        # begin past the live position; moving that would make the live applier skip the cells in between.
        self.stream: Stream | None = "live"
        self._result_lock = threading.Lock()

    def prepare(self, cell: Cell) -> IndexChange:
        """The cell's change: a tombstone's removes the row's entry (``values`` None); EntryFieldError
        (non-retriable) when any other body does not fit the definition."""
        return change_of(self.definition, cell)

    def apply(self, changes: Sequence[IndexChange], batch: Sequence[Cell] = (), *,
              stream: Stream | EllipsisType | None = ...) -> ApplyResult:
        """(blocking) Apply a batch, recording the stream's position with it (``stream``, default the applier's
        :attr:`stream`; None records none): past every cell of ``batch`` (its cells that were dead-lettered
        included), or past the last change."""
        if stream is ...:
            stream = self.stream
        if self.dropped:
            return ApplyResult(skipped=len(changes))
        through: dict[int, int] = {}
        for cell in batch:
            through[cell.shard] = max(cell.added_id, through.get(cell.shard, 0))
        try:
            result = self.store.indexes.apply(self.spec, changes, stream, through)
        except LogstoreError as exc:
            if not exc.retriable and self._was_dropped():
                return ApplyResult(skipped=len(changes))
            raise
        with self._result_lock:
            self.result += result
        return result

    def apply_one(self, cell: Cell) -> None:
        """One cell, outside any stream's position: a dead letter's replay, or a batch that failed split up."""
        self.apply([self.prepare(cell)], stream=None)

    def _was_dropped(self) -> bool:
        """Whether the version was dropped meanwhile (its tables are gone): then the app stops keeping it."""
        record = IndexCatalog(self.store).find(self.definition.name)
        found = record.versions.get(self.definition.version) if record else None
        if found is None or found.state == "dropped":
            logger.warning("index %s version %d was dropped; this app stops keeping it current",
                           self.definition.name, self.definition.version)
            self.dropped = True
        return self.dropped


class Index:
    """Queries of one index: its active version (or ``version``), read from the catalog. Through a worker node's
    client (a store opened by ``http://`` URL) the node reads the catalog and the entries; a query it cut to its
    ``max_read_bytes`` comes back a :class:`~logstore.persistence.TruncatedPage` of the first entries."""

    def __init__(self, store: Store, name: str, *, version: int | None = None) -> None:
        self.store = store
        self.name = name
        self._pinned = version
        self._catalog = IndexCatalog(store)
        self._record: IndexRecord | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()

    def _current(self, refresh: bool = False) -> IndexDefinition:
        if self.store.index_queries_remote:
            return self._node_definition()
        record = self._record
        if refresh or record is None or time.monotonic() - self._read_at > _REFRESH:
            with self._lock:
                self._record = record = self._catalog.get(self.name)
                self._read_at = time.monotonic()
        if self._pinned is not None:
            return record.version(self._pinned).definition
        if record.active is None:
            states = ", ".join(f"{v} {r.state}" for v, r in sorted(record.versions.items())) or "none"
            raise IndexStateError(f"index {self.name} has no active version yet (versions: {states}); "
                                  f"backfill one and activate it")
        return record.version(record.active).definition

    @property
    def definition(self) -> IndexDefinition:
        """The definition of the version queries read now."""
        return self._current()

    def query(self, *, limit: int = 100, order: str = "asc", scatter: bool = False,
              **fields: Any) -> list[IndexEntry]:
        """Entries whose key fields match: ``field=value`` is equality, ``field=(start, end)`` a range
        (start included, end excluded, None for an open end). Naming the shard field reads one shard;
        without it the query must say ``scatter=True`` and reads every shard. Entries come ordered by the
        keys after the shard field (in the definition's order), then row_key."""
        if order not in ("asc", "desc"):
            raise InvalidQueryError(f"order must be 'asc' or 'desc', got {order!r}")
        if type(limit) is not int or not 1 <= limit <= MAX_QUERY_LIMIT:
            raise InvalidQueryError(f"limit must be an integer in [1, {MAX_QUERY_LIMIT}], got {limit!r}")
        if self.store.index_queries_remote:
            return self._ask_node(fields, limit=limit, order=order, scatter=scatter)
        definition = self._current()
        conditions = self._conditions(definition, fields)
        if not scatter and not any(c.field == definition.shard_field and c.op == "=" for c in conditions):
            raise InvalidQueryError(f"index {self.name}: a query without {definition.shard_field} reads every "
                                    "shard; ask for it with scatter=True")
        try:
            return self.store.indexes.query(definition.spec, conditions, order=order,  # type: ignore[arg-type]
                                            limit=limit, scatter=scatter)
        except LogstoreError as exc:
            if exc.retriable or isinstance(exc, InvalidArgumentError):
                raise
            # The version may have been switched and dropped since the catalog was read: read it again.
            fresh = self._current(refresh=True)
            if fresh == definition:
                raise
            return self.store.indexes.query(fresh.spec, self._conditions(fresh, fields), order=order,  # type: ignore[arg-type]
                                            limit=limit, scatter=scatter)

    def _node_definition(self) -> IndexDefinition:
        """The version queries read, as the worker node's catalog has it (its client reads no catalog cell)."""
        with _as_indexer_errors():
            found = self.store.index_info(self.name).version(self._pinned)
        return IndexDefinition.model_validate({**found.spec.model_dump(), "column": found.column})

    def _ask_node(self, fields: dict[str, Any], *, limit: int, order: str, scatter: bool) -> list[IndexEntry]:
        """The query of a worker node's client, which the node reads (its catalog included)."""
        with _as_indexer_errors():
            return self.store.query_index(self.name, fields, order="desc" if order == "desc" else "asc",
                                          limit=limit, scatter=scatter, version=self._pinned)

    def _conditions(self, definition: IndexDefinition, fields: dict[str, Any]) -> list[Condition]:
        # logstore's reading of conditions, which a worker node's index queries use too
        try:
            return [Condition(*c) for c in conditions(definition.spec, self.name, fields)]
        except InvalidConditionError as exc:
            raise InvalidQueryError(str(exc)) from None


@contextlib.contextmanager
def _as_indexer_errors() -> Iterator[None]:
    """A worker node's refusals of a query as the local reading raises them."""
    try:
        yield
    except InvalidArgumentError as exc:  # a condition, or scatter missing
        raise InvalidQueryError(str(exc)) from None
    except IndexUnknownError as exc:
        raise IndexNotFoundError(str(exc)) from None
    except IndexInactiveError as exc:
        raise IndexStateError(str(exc)) from None


def lag(store: Store, definition: IndexDefinition) -> tuple[int, float]:
    """How far live processing of a version is behind the log: the cells of its column after its
    positions, and the age in seconds of the oldest of them (0 when none). The first cell after every
    position comes in one read of many shards; the shards that have one are counted in a few reads per
    storage node."""
    positions = store.indexes.positions(definition.spec, "live")
    column = [definition.column]
    locations = {shard: positions[shard].location if shard in positions else 0 for shard in range(store.shard_count)}
    pending: dict[int, int] = {}
    oldest = None
    for shard, page in store.get_cells_for_shards(locations, 1, columns=column).items():
        if isinstance(page, CorruptCellError):
            created = page.created_at  # a damaged cell lags like any other
        elif page:
            created = page[0].created_at
        else:
            continue
        pending[shard] = locations[shard]
        if created is not None and (oldest is None or created < oldest):
            oldest = created
    behind = sum(store.counts_after(pending, columns=column).values()) if pending else 0
    seconds = (dt.datetime.now(dt.UTC) - oldest).total_seconds() if oldest is not None else 0.0
    return behind, max(0.0, seconds)
