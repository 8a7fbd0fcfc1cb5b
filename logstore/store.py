"""The store: validation, encoding and routing of cells to the storage nodes that hold their shards."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from types import TracebackType
from typing import Any, NamedTuple, NoReturn, cast

from logstore.cell import (
    Cell,
    PackedCell,
    check_column,
    check_ref_key,
    coerce_row_key,
    compress,
    pack_body,
    same_json,
    shard_of,
)
from logstore.config import ClusterConfig, NodeConfig, StoreOptions
from logstore.errors import (
    CellConflictError,
    ConfigurationError,
    CorruptCellError,
    InvalidArgumentError,
    InvalidCellError,
    LogstoreError,
    ReadOnlyStoreError,
    ShardMovedError,
    StorageError,
    StorageUnavailableError,
)
from logstore.index_tables.persistence import IndexEntry, IndexRecorder, Order
from logstore.index_tables.query import IndexInfo, index_info, query_index
from logstore.index_tables.store import IndexStore
from logstore.log_blocks import LogBlock
from logstore.offsets import OffsetRecord, offset_doc
from logstore.persistence import (
    CellRead,
    ChangedCounts,
    Coordinates,
    NodeMeta,
    NodeRecorder,
    PendingCell,
    PendingCounts,
    PendingRecord,
    PendingReport,
    ReadBudget,
    TruncatedPage,
    UndecodedPages,
)
from logstore.shard_map import MapNode, ShardMapDoc, ranges, seed, where_of

logger = logging.getLogger(__name__)
MAX_PAGE = 100_000
_MOVE_HOPS = 40  # a write meeting a moved shard reloads the map and tries again, this many times at most
DOWN_RECHECK = 1.0  # seconds between the background checks of a node known down (Store.known_down)


class ShardInfo(NamedTuple):
    shard: int
    node: str
    cells: int


class CountsMark(NamedTuple):
    """A mark of :meth:`Store.changed_counts`: each node's mark, for the shard map it was taken under. Made of
    JSON's values (tuples for arrays), so a worker node hands it to its clients and takes it back
    (:func:`logstore.node.wire.encode_mark`)."""

    map_changes: int
    nodes: dict[str, object | None]


class Store:
    """A logstore instance: a fixed number of shards spread over storage nodes.

    Safe to share between threads. Use :func:`logstore.open` to get one.
    """

    def __init__(
        self, cluster: ClusterConfig, recorders: dict[str, NodeRecorder], options: StoreOptions,
        connect: Callable[[NodeConfig], NodeRecorder] | None = None,
    ) -> None:
        self._cluster = cluster
        self._options = options
        # Replaced whole, never changed in place, when the map brings or retires a node: a thread going
        # over the nodes while the map changes goes over the ones it started with.
        self._recorders = recorders
        self._connect = connect  # opens a node the shard map names and the cluster file does not
        self._file_nodes = {node.name: node for node in cluster.nodes}
        # Where each open node's recorder connects: a promotion changes it in the map, and the node is reopened.
        self._opened_at = {node.name: where_of(node) for node in cluster.nodes}
        self._pinned: set[str] = set()  # reopened ahead of the map (reopen_node): kept until the map agrees
        self._mirror: str | None = None  # the instance this one mirrors (read-only), as last read
        self._mirror_read = float("-inf")
        self._doc = seed(cluster)
        self._base = self._doc.base(cluster.shards)  # each shard's node by the map's version, before moves
        self._node_of: list[str] = list(self._base)
        self._retired: list[NodeRecorder] = []  # removed nodes' recorders, closed with the store
        self._moves: dict[str, dict[int, str]] = {}  # node -> its shards moved away, and where
        self._silent: dict[str, float] = {}  # node -> when to read its map again, after it did not answer
        self._map_read = 0.0
        self._map_changes = 0  # how often the shard map changed: a mark of changed_counts holds for one map
        self._map_lock = threading.Lock()
        self._movable = any(r.supports_moves for r in recorders.values())  # else the map never changes
        self._closed = False
        self._closing = threading.Event()  # wakes the background checks of down nodes at close
        # Nodes known down (name -> since, monotonic): their writes are buffered at once, not after buffer_after
        # again each, until a background check finds the primary answering (:meth:`known_down`).
        self._down: dict[str, float] = {}
        self._down_lock = threading.Lock()
        self.down_recheck = DOWN_RECHECK
        self._refreshing = False  # a write started a read of the shard map on a thread of its own
        self._indexes: IndexStore | None = None
        self.refresh_map()
        after = options.buffer_after
        self._buffer_retry = options.retry.model_copy(update={"deadline": after}) if after is not None else None
        self._one_try = options.retry.model_copy(update={"max_attempts": 1})  # a node known down: asked once

    # -- instance ---------------------------------------------------------
    @property
    def shard_count(self) -> int:
        return self._cluster.shards

    @property
    def options(self) -> StoreOptions:
        return self._options

    @property
    def nodes(self) -> list[str]:
        """The storage nodes in use (the shard map's, not removed), by name."""
        return sorted(self._recorders)

    @property
    def shard_map(self) -> ShardMapDoc:
        """The version of the shard map the store follows (:mod:`logstore.shard_map`; version 0: the cluster
        file's). Where each shard is now: :meth:`node_of`."""
        return self._doc

    @property
    def parallel_reads(self) -> int:
        """Log reads worth running at once from one process (the least any node gains from): the default
        read-ahead of the readers that tail the store."""
        return min(r.parallel_reads for r in self._recorders.values())

    @property
    def parallel_writes(self) -> int:
        """Write transactions of different shards worth running at once from one process (the least any node
        gains from): the calls an index applier makes at once."""
        return min(r.parallel_writes for r in self._recorders.values())

    def node_config(self, entry: MapNode) -> NodeConfig:
        """How this process opens the node of a shard map entry (:meth:`MapNode.config_over` the cluster
        file's entry of that name, which gives the passwords).

        Raises:
            ConfigurationError: the entry does not make a valid node here.
        """
        return entry.config_over(self._file_nodes.get(entry.name))

    def node_recorder(self, name: str) -> NodeRecorder | None:
        """The recorder of storage node ``name`` (None when the cluster has no such node): for
        backend-level operations such as shard moves."""
        return self._recorders.get(name)

    @property
    def indexes(self) -> IndexStore:
        """The secondary index tables on the store's nodes (:mod:`logstore.index_tables.store`)."""
        if self._indexes is None:
            for recorder in self._recorders.values():
                recorder.indexes  # noqa: B018 - a node that serves none (a worker node) says so now
            self._indexes = IndexStore(_IndexRouter(self))
        return self._indexes

    @property
    def index_queries_remote(self) -> bool:
        """Whether index queries go to a worker node (this store is its client): ``indexes`` is then refused and
        :meth:`query_index` asks the node, which reads its catalog and index tables."""
        return self._index_node() is not None

    def _index_node(self) -> NodeRecorder | None:
        """The recorder of a worker node's client (it holds every shard), which answers index queries itself."""
        return next((r for r in self._recorders.values() if r.answers_index_queries), None)

    def index_info(self, name: str) -> IndexInfo:
        """Index ``name`` as the index catalog has it now: its versions (dropped ones left out), their states and
        fields, the active one; read by the worker node for its client.

        Raises:
            IndexUnknownError: no index of that name.
        """
        remote = self._index_node()
        return remote.index_info(name) if remote is not None else index_info(self, name)

    def query_index(self, name: str, where: Mapping[str, Any], *, order: Order = "asc", limit: int = 100,
                    scatter: bool = False, version: int | None = None) -> list[IndexEntry]:
        """Entries of index ``name`` (its active version, or ``version``) matching ``where``, read here or, for a
        worker node's client, by the node (``POST /v1/indexes/{name}/query``).

        Args:
            where: ``key=value`` an equality, ``key=(start, end)`` a range (start included, end excluded, None an
                open end); values as a cell's body has them, or typed (a ``uuid.UUID``, an aware ``datetime``).
            order: of the keys after the shard field, then row_key.
            limit: 1 to 100,000 entries.
            scatter: required when ``where`` has no equality on the shard field (every shard is read).
            version: a version to read whatever its state; the active one when None.

        Returns:
            The entries, fields typed as the version declares them. Through a worker node, an answer the node cut
            to its ``max_read_bytes`` is a :class:`~logstore.persistence.TruncatedPage` of the first entries.

        Raises:
            IndexUnknownError: no such index or version.
            IndexInactiveError: no version named and none active.
            InvalidConditionError: a bad condition, or no shard field without ``scatter``.
            InvalidArgumentError: a bad order or limit.
        """
        remote = self._index_node()
        if remote is not None:
            return remote.query_index(name, where, order=order, limit=limit, scatter=scatter, version=version)
        return query_index(self, name, where, order=order, limit=limit, scatter=scatter, version=version)[1]

    def shard_of(self, row_key: uuid.UUID | str) -> int:
        return shard_of(coerce_row_key(row_key), self._cluster.shards)

    def node_of(self, shard: int) -> str:
        return self._node_of[self.check_shard(shard)]

    def placement(self) -> list[str]:
        """Each shard's node, by shard, as the store last read the map."""
        return list(self._node_of)

    def _recorder(self, shard: int) -> NodeRecorder:
        self._fresh_map()
        return self._named(self._node_of[shard])

    def _named(self, name: str) -> NodeRecorder:
        recorder = self._recorders.get(name)
        if recorder is None:  # named by the map, and this process could not open it (see refresh_map's log)
            raise StorageUnavailableError(f"storage node {name} of the shard map is not open in this process")
        return recorder

    def _fresh_map(self) -> None:
        """Raise if the store is closed; read the shard map again when it is due."""
        if self._closed:
            raise StorageError("the store is closed")
        if self._movable and time.monotonic() - self._map_read > self._options.map_refresh:
            self.refresh_map()

    def _locations_by_node(self, locations: Mapping[int, int]) -> list[tuple[NodeRecorder, list[tuple[int, int]]]]:
        """The (shard, location) pairs, each checked, grouped by storage node in one pass over the map: a
        4096-shard reader asks for thousands at once, and a trip through :meth:`_recorder` for each (the
        closed flag and the map's age every time) is paid once here."""
        self._fresh_map()  # once for all of them
        node_of, shards = self._node_of, self._cluster.shards
        by_node: dict[str, list[tuple[int, int]]] = {}
        for shard, location in locations.items():
            if type(shard) is not int or not 0 <= shard < shards:
                self.check_shard(shard)  # raises, naming it
            if type(location) is not int or not 0 <= location < 1 << 63:
                _bad_location(location)
            name = node_of[shard]
            if (group := by_node.get(name)) is None:
                group = by_node[name] = []
            group.append((shard, location))
        return [(self._named(name), group) for name, group in by_node.items()]

    def refresh_map(self) -> None:
        """Read the shard map (:mod:`logstore.shard_map`): its newest version any node holds, and the shard
        moves the nodes record since (``cellstream shards move``).

        Called at open, every ``map_refresh`` seconds by reads, and at once when a write meets a moved
        shard, so every process follows a move or a node added or removed without a restart. A node that
        does not answer keeps its last known moves; one the map names that cannot be opened here is logged
        and tried again at the next refresh (its shards' calls raise StorageUnavailableError meanwhile).
        """
        if not self._movable:
            return
        with self._map_lock:
            self._map_read = time.monotonic()
            newest: tuple[int, str] | None = None
            held: dict[str, int] = {}
            marks: list[str | None] = []
            for name, recorder in self._recorders.items():
                # A node known down is not asked: a write that found the map due must not wait for it.
                if not recorder.supports_moves or self._silent.get(name, 0.0) > self._map_read or name in self._down:
                    continue
                try:
                    found = recorder.read_map()
                    self._moves[name] = recorder.moves()
                    marks.append(recorder.read_marker("mirror_of"))
                except StorageUnavailableError as exc:
                    # Asked again after two refreshes: meanwhile no read or write that finds the map due waits
                    # for it (its replicas, if any, answered for it already: read_map falls back to them).
                    self._silent[name] = self._map_read + 2 * self._options.map_refresh
                    logger.warning("cannot read the shard map of node %s: %s", name, exc)
                    continue
                self._silent.pop(name, None)
                held[name] = found[0] if found else 0
                if found is not None and (newest is None or found[0] > newest[0]):
                    newest = found
            if marks:  # every node of a mirror is marked: those that answered tell
                self._mirror, self._mirror_read = next((m for m in marks if m), None), self._map_read
            changed = False
            if newest is not None and newest[0] > self._doc.version:
                self._doc = ShardMapDoc.from_json(newest[1])
                self._base = self._doc.base(self._cluster.shards)
                changed = True
            before = set(self._recorders)
            self._open_map_nodes()
            opened = set(self._recorders) - before
            changed |= set(self._recorders) != before
            self._catch_up({**held, **dict.fromkeys(opened, 0)})  # a node just opened answered its initialize
            node_of = list(self._base)
            recorders = self._recorders
            for shard in {s for moved in self._moves.values() for s in moved if 0 <= s < len(node_of)}:
                for _ in range(len(recorders)):  # follow moves from node to node, never in a loop
                    target = self._moves.get(node_of[shard], {}).get(shard)
                    if target is None or target not in recorders:
                        break
                    node_of[shard] = target
            if changed or node_of != self._node_of:
                self._map_changes += 1
                self._node_of[:] = node_of

    def _open_map_nodes(self) -> None:
        """Open the map's nodes this process has not, retire the removed ones."""
        live = {node.name: node for node in self._doc.live}
        recorders = dict(self._recorders)
        for name in [n for n in recorders if n not in live and self._doc.version]:
            self._retired.append(recorders.pop(name))
            self._moves.pop(name, None)
            logger.info("storage node %s was removed from the shard map: no longer used", name)
        for name, entry in live.items():
            if name in self._pinned:
                if self._opened_at.get(name) != entry.where:
                    continue
                self._pinned.discard(name)
            promoted = name in recorders and self._opened_at.get(name, entry.where) != entry.where
            if name in recorders and not promoted:
                continue
            if self._connect is None:
                logger.warning("storage node %s of the shard map cannot be opened: this store opens no nodes", name)
                continue
            try:
                recorder = self._connect(entry.config_over(self._file_nodes.get(name)))
            except (ConfigurationError, StorageError) as exc:
                logger.error("storage node %s of the shard map cannot be opened here: %s", name, exc)
                continue
            if promoted:  # a replica promoted: the former primary is never written again by this process
                self._retired.append(recorders[name])
                self._silent.pop(name, None)  # the old primary's silence is not the new one's
                self._mark_up(name)
                logger.warning("storage node %s has a new primary (%s): reopened there", name, entry.url)
            else:
                logger.info("storage node %s joined the shard map: opened", name)
            recorders[name] = recorder
            self._opened_at[name] = entry.where
        if recorders != self._recorders:
            self._recorders = recorders

    def reopen_node(self, name: str, config: NodeConfig) -> None:
        """Open node ``name`` at ``config``'s URLs in this process now, before the shard map says so (the
        process promoting a replica records the new version through it). The former recorder is closed with
        the store.

        Raises:
            InvalidArgumentError: no node ``name`` is open.
            ConfigurationError: this store opens no nodes.
            StorageError: the node cannot be opened there.
        """
        if name not in self._recorders:
            raise InvalidArgumentError(f"no storage node {name!r} is open in this store")
        if self._connect is None:
            raise ConfigurationError("this store opens no nodes")
        recorder = self._connect(config)
        with self._map_lock:
            recorders = dict(self._recorders)
            self._retired.append(recorders[name])
            recorders[name] = recorder
            self._recorders = recorders
            self._opened_at[name] = where_of(config)
            self._pinned.add(name)
            self._silent.pop(name, None)
        self._mark_up(name)  # the new primary answers (it was just opened)

    def _catch_up(self, held: dict[str, int]) -> None:
        """Write the newest version to the nodes that answered with an older one (down when it was written, or
        new). One that did not answer is left for a later refresh: no write waits on it."""
        if not self._doc.version:
            return
        for name, recorder in self._recorders.items():
            if name in held and held[name] < self._doc.version:
                try:
                    recorder.write_map(self._doc.version, self._doc.to_json())
                except (StorageUnavailableError, ConfigurationError) as exc:
                    logger.warning("cannot record the shard map's version %d on node %s: %s",
                                   self._doc.version, name, exc)

    def publish_map(self, change: Callable[[ShardMapDoc, list[str]], ShardMapDoc]) -> ShardMapDoc:
        """Record a new version of the shard map: ``change(current, placement)`` gives it (its version is set
        here). The version is recorded first on the lowest-named node of the current version (so of two
        writers of one version one wins, and the other's ``change`` runs again on the winner's), then on
        every other node (one that does not answer is caught up by the next refresh of any process).

        Raises:
            ConfigurationError: a single-node store (SQLite, a worker node), or ``change``'s own.
            StorageUnavailableError: the first node did not answer.
            StorageError: the map kept changing under this writer.
        """
        if not self._movable:
            raise ConfigurationError("this store keeps no shard map: it is a single-node store")
        for _ in range(10):
            self.refresh_map()
            current = self._doc
            doc = change(current, list(self._node_of)).model_copy(
                update={"version": current.version + 1, "placement": None})
            doc = doc.model_copy(update={"placement": ranges(self._placement_of(doc))})
            first = min(n.name for n in current.live)
            if not self._named(first).write_map(doc.version, doc.to_json()):
                continue  # another writer recorded this version first: change the newer one
            for name in sorted(self._recorders):
                if name != first:
                    with suppress(StorageUnavailableError):
                        self._recorders[name].write_map(doc.version, doc.to_json())
            self.refresh_map()
            logger.info("shard map version %d recorded", doc.version)
            return doc
        raise StorageError("the shard map changed ten times while this change was being recorded")

    def _placement_of(self, doc: ShardMapDoc) -> list[str]:
        """The placement a new version records: where each shard is now (none on a node it removes)."""
        placement = list(self._node_of)
        live = {n.name for n in doc.live}
        if stray := sorted({name for name in placement if name not in live}):
            raise ConfigurationError(f"node {stray[0]} still holds shards: move them away first "
                                     f"(cellstream nodes drain {stray[0]})")
        return placement

    def check_shard(self, shard: object) -> int:
        """``shard`` when it is a shard of this store; InvalidArgumentError naming it otherwise."""
        if type(shard) is not int or not 0 <= shard < self._cluster.shards:
            raise InvalidArgumentError(f"shard must be an integer in [0, {self._cluster.shards}), got {shard!r}")
        return shard

    # -- writes -----------------------------------------------------------
    def _pending(self, row_key: object, column: object, ref_key: object, body: object,
                 allow_reserved: bool) -> PendingCell:
        key = coerce_row_key(row_key)
        name = check_column(column, allow_reserved=allow_reserved)
        ref = check_ref_key(ref_key)
        packed = pack_body(body, self._options.max_body_bytes)
        blob = compress(packed, self._options.compression_level)
        return PendingCell(shard_of(key, self._cluster.shards), key, name, ref, body, blob)  # type: ignore[arg-type]

    def put_cell(self, row_key: uuid.UUID | str, column: str, ref_key: int, body: dict[str, Any]) -> Cell:
        """Write one cell. Writing it again with an identical body returns the stored cell.

        Args:
            row_key: the row, a UUID (or its text).
            column: the column's name (not ``_``-prefixed: those are cellstream's own).
            ref_key: the cell's version within (row_key, column), an integer in [0, 2^63).
            body: a JSON object; kept as given, so do not mutate it afterwards.

        Returns:
            The stored cell, with its shard, ``added_id`` and ``created_at`` (``added_id`` 0 when the write
            was buffered on another node while its own did not answer); its ``body`` is the dict passed.

        Raises:
            InvalidCellError: a row key, column, ref_key or body that is not valid (nothing is written).
            CellConflictError: the cell exists with another body.
            StorageUnavailableError: the storage node did not answer within the retry policy (retriable).
            StorageError: the store is closed, or the node failed otherwise.
        """
        return self._put([self._pending(row_key, column, ref_key, body, False)])[0]

    def put_cells(self, cells: Iterable[tuple[uuid.UUID | str, str, int, dict[str, Any]]]) -> list[Cell]:
        """Write many cells: all are validated before any is written; atomic per storage node. Safe to retry
        whole; the same coordinates twice in ``cells`` are one write (a conflict if the bodies differ).

        Args:
            cells: (row_key, column, ref_key, body) tuples, each as :meth:`put_cell` takes them.

        Returns:
            The stored cell for each input, in order.

        Raises:
            InvalidArgumentError: an item that is not a 4-tuple (nothing is written).
            InvalidCellError: an invalid cell, its ``index`` in ``cells`` given (nothing is written).
            CellConflictError: a cell exists with another body (nothing of its storage node's is written).
            StorageUnavailableError: a storage node did not answer within the retry policy (retriable).
            StorageError: the store is closed, or a node failed otherwise.
        """
        return self._put(self._validate_many(cells, allow_reserved=False))

    def put_system_cells(self, cells: Iterable[tuple[uuid.UUID | str, str, int, dict[str, Any]]]) -> list[Cell]:
        """:meth:`put_cells` for cellstream's own ``_``-prefixed columns (offsets, dead letters) as well: same
        arguments, result and errors."""
        return self._put(self._validate_many(cells, allow_reserved=True))

    def _validate_many(self, cells: Iterable[Any], allow_reserved: bool) -> list[PendingCell]:
        out = []
        for index, item in enumerate(cells):
            try:
                row_key, column, ref_key, body = item
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"cell #{index}: expected a (row_key, column, ref_key, body) tuple"
                ) from None
            try:
                out.append(self._pending(row_key, column, ref_key, body, allow_reserved))
            except InvalidCellError as exc:
                raise InvalidCellError(exc.field, exc.problem, index=index) from None
        return out

    def mirror_of(self) -> str | None:
        """The instance this store is a standby mirror of (``cellstream mirror run`` marks its nodes), read
        afresh; None when it is writable. A node that does not answer, or known down, is passed over."""
        for name, recorder in sorted(self._recorders.items()):
            if name in self._down:
                continue
            try:
                if value := recorder.read_marker("mirror_of"):
                    return value
            except StorageUnavailableError:
                continue
        return None

    def _check_writable(self) -> None:
        """Refuse a write to a standby mirror: its mark as the last map read found it (a multi-node store reads
        it with the map, off the write path); a single-node store reads it every ``map_refresh`` seconds."""
        now = time.monotonic()
        if not self._movable and now - self._mirror_read > self._options.map_refresh:
            self._mirror, self._mirror_read = self.mirror_of(), now
        if self._mirror:
            raise ReadOnlyStoreError(f"this instance is a standby mirror of {self._mirror}: only the mirror writes "
                                     "to it (`cellstream mirror promote --to URL` makes it writable); nothing was "
                                     "written")

    def _put(self, pending: list[PendingCell]) -> list[Cell]:
        if not pending:
            return []
        self._check_writable()
        # The same coordinates twice in one batch: one write if the bodies agree, a conflict if not.
        unique: dict[Coordinates, PendingCell] = {}
        for cell in pending:
            seen = unique.setdefault(cell.coordinates, cell)
            if seen is not cell and not same_json(seen.body, cell.body):
                raise CellConflictError(cell.row_key, cell.column, cell.ref_key)
        stored: dict[Coordinates, Cell] = {}
        todo = list(unique.values())
        self._refresh_soon()
        for attempt in range(_MOVE_HOPS):
            moved: list[PendingCell] = []
            by_node: dict[str, list[PendingCell]] = {}
            for cell in todo:
                by_node.setdefault(self._node_of[cell.shard], []).append(cell)
            for name in sorted(by_node):
                if self._closed:
                    raise StorageError("the store is closed")
                group = by_node[name]
                buffers = self._buffers_for(name)
                try:
                    if buffers and (since := self._down.get(name)) is not None:
                        raise StorageUnavailableError(f"storage node {name} is down (for {time.monotonic() - since:.0f}"
                                                      f" s; checked again every {self.down_recheck:g} s)")
                    results = self._named(name).insert(group, self._buffer_retry if buffers else None)
                except StorageUnavailableError as exc:
                    if buffers:
                        self._mark_down(name, exc)
                    results = self._buffer(name, group, buffers, exc)
                except ShardMovedError as exc:
                    if attempt == _MOVE_HOPS - 1:
                        raise
                    logger.info("%s: reloading the shard map", exc)
                    moved.extend(group)  # nothing of the group was written: the node refused it whole
                    continue
                else:
                    if self._options.durable_writes:
                        self._hold(name, group, results)
                for cell, result in zip(group, results, strict=True):
                    stored[cell.coordinates] = result
            if not moved:
                break
            self._follow_moves(attempt)
            todo = moved
        return [stored[c.coordinates] for c in pending]

    def _refresh_soon(self) -> None:
        """Read the shard map again, when due, on a thread of its own: a write does not wait for it, as reading it
        asks every node, and one that does not answer held every write that found the map due (for seconds, each
        map_refresh). A write that meets a moved shard still reads it at once (:meth:`_follow_moves`)."""
        if not self._movable or time.monotonic() - self._map_read <= self._options.map_refresh:
            return
        with self._down_lock:
            if self._refreshing:
                return
            self._refreshing = True
        threading.Thread(target=self._refresh_in_background, name="logstore-map-refresh", daemon=True).start()

    def _refresh_in_background(self) -> None:
        try:
            if not self._closed:
                self.refresh_map()
        except LogstoreError as exc:  # the next write that finds it due tries again
            if not self._closed:
                logger.warning("cannot read the shard map: %s", exc)
        finally:
            self._refreshing = False

    def _follow_moves(self, attempt: int) -> None:
        """Before trying again what met a moved shard: read the map (after a moment, from the second try on:
        the move's switch is under way, and its record lands in a moment)."""
        if attempt:
            time.sleep(0.05 * attempt)
        self.refresh_map()

    def _hold(self, home: str, group: list[PendingCell], results: list[Cell]) -> None:
        """Durable buffered writes (:mod:`logstore.durable`): a copy of what ``home``'s primary just stored, on
        another MySQL node, before the write is acknowledged; nothing when ``home`` has no replica to promote.

        Raises:
            StorageUnavailableError: no other node took the copy (the write is on the primary, not
                acknowledged: a retry is safe, as every put is).
        """
        from logstore.durable import copies_of

        if not self._named(home).replicated:
            return
        copies = copies_of(group, results)
        if not copies:
            return
        failed: StorageUnavailableError | None = None
        names = sorted(self._recorders)
        after = names.index(home) + 1 if home in names else 0
        for name in names[after:] + names[:after]:  # the next node after home first: copies spread over a ring
            recorder = self._recorders[name]
            if name == home or not recorder.supports_pending or name in self._down:
                continue
            try:
                recorder.hold_copies(home, copies)
                return
            except StorageUnavailableError as exc:
                failed = exc
        raise StorageUnavailableError(f"node {home}'s primary stored {len(copies)} cells but no other node holds "
                                      f"their durable copy ({failed or 'no other MySQL node'}): not acknowledged; "
                                      "a retry is safe")

    # -- buffered writes ----------------------------------------------------
    @property
    def buffers_writes(self) -> bool:
        """Whether a write to an unavailable primary can be buffered on another node (then someone must run
        :meth:`replay_pending`: a worker node does, every second)."""
        return any(self._buffers_for(name) for name in self._recorders)

    def _buffers_for(self, node: str) -> list[str]:
        """The other nodes that can hold ``node``'s writes while its primary is unavailable."""
        if self._options.buffer_after is None:
            return []
        return [n for n in sorted(self._recorders) if n != node and self._recorders[n].supports_pending]

    def known_down(self) -> dict[str, float]:
        """The nodes a write found unavailable (after ``buffer_after``) and that have not answered since, with
        the seconds since: writes to them are buffered at once and the shard map is not read from them, until
        a background check (every :attr:`down_recheck` seconds, on its own thread) or a replayed write finds
        the primary answering."""
        now = time.monotonic()
        with self._down_lock:
            return {name: now - since for name, since in sorted(self._down.items())}

    def _mark_down(self, name: str, failure: StorageUnavailableError) -> None:
        with self._down_lock:
            if name in self._down or self._closed:
                return
            self._down[name] = time.monotonic()
        logger.warning("storage node %s is down (%s): its writes are buffered at once until it answers again",
                       name, failure)
        threading.Thread(target=self._recheck, args=(name,), name=f"logstore-recheck-{name}", daemon=True).start()

    def _mark_up(self, name: str) -> None:
        with self._down_lock:
            since = self._down.pop(name, None)
        if since is not None:
            logger.info("storage node %s answers again after %.1f s: writes go to it again", name,
                        time.monotonic() - since)

    def _recheck(self, name: str) -> None:
        """Ask a node known down, every ``down_recheck`` seconds, until its primary answers (or the store closes,
        or the node leaves the map). No write waits for this."""
        while name in self._down and not self._closing.wait(self.down_recheck):
            recorder = self._recorders.get(name)
            if recorder is None:  # removed from the map meanwhile
                break
            try:
                # The primary itself, not a replica: what a write needs. Without a pending table, the read of the
                # node's metadata.
                if recorder.supports_pending:
                    recorder.pending_counts()
                else:
                    recorder.read_meta(self._one_try)
            except StorageError as exc:
                logger.debug("storage node %s is still down: %s", name, exc)
                continue
            except ConfigurationError as exc:  # it came back as something else: writes find out and say so
                logger.error("storage node %s answers, but: %s", name, exc)
            break
        if not self._closing.is_set():
            self._mark_up(name)

    def _buffer(self, node: str, group: list[PendingCell], buffers: list[str],
                failure: StorageUnavailableError) -> list[Cell]:
        for other in buffers:
            try:
                self._named(other).buffer(node, group)
            except StorageUnavailableError as exc:
                logger.warning("cannot buffer %d cells of node %s on node %s either: %s", len(group), node, other, exc)
                continue
            logger.warning("node %s unavailable (%s): %d cells buffered on node %s until it returns",
                           node, failure, len(group), other)
            now = dt.datetime.now(dt.UTC)
            # added_id 0: the cell has no place in its shard's log until it is written home.
            return [Cell(c.row_key, c.column, c.ref_key, c.body, 0, c.shard, now) for c in group]
        raise failure

    def replay_pending(self, limit: int = 1000) -> PendingReport:
        """Write buffered cells home to nodes whose primary answers again (any order: cells are idempotent).

        A cell that conflicts with one written home meanwhile stays buffered, marked failed with the reason.
        Returns what was written home, marked failed, and is still waiting.
        """
        replayed = failed = waiting = 0
        unreachable: list[str] = []
        for name, holder in sorted(self._recorders.items()):
            try:
                behind = holder.replay_behind()  # a worker node: its store's pass, run there
            except StorageUnavailableError as exc:
                logger.warning("cannot replay the buffered cells behind node %s: %s", name, exc)
                unreachable.append(name)
                continue
            if behind is not None:
                replayed, failed, waiting = replayed + behind.replayed, failed + behind.failed, waiting + behind.waiting
                unreachable += behind.unreachable
                continue
            if not holder.supports_pending:
                continue
            if name in self._down:  # asked by the background check, not by every pass
                unreachable.append(name)
                continue
            try:
                done, bad = self._replay_from(holder, limit)
                waiting += sum(w for w, _ in holder.pending_counts().values())
            except StorageUnavailableError as exc:
                logger.warning("buffered cells on node %s wait: it does not answer (%s)", name, exc)
                unreachable.append(name)
                continue
            replayed, failed = replayed + done, failed + bad
        if len(self._recorders) > 1 and any(r.supports_pending for r in self._recorders.values()):
            from logstore.durable import trim_copies

            trim_copies(self)  # durable copies the home's replicas hold now (durable buffered writes)
        return PendingReport(replayed, failed, waiting, unreachable)

    def _replay_from(self, holder: NodeRecorder, limit: int) -> tuple[int, int]:
        replayed = failed = 0
        by_node: dict[str, list[PendingRecord]] = {}
        for record in holder.pending(limit):  # home is where the shard is now: it may have moved meanwhile
            by_node.setdefault(self._node_of[record.cell.shard], []).append(record)
        for node, records in by_node.items():
            home = self._recorders.get(node)
            if home is None:
                continue  # not open here (yet): the next pass
            try:
                # A home known down is asked once: for many passes it answers with a refusal.
                cells = [r.cell for r in records]
                stored = home.insert(cells, self._one_try if node in self._down else self._buffer_retry)
                if self._options.durable_writes and home.replicated:  # held here until its replicas have it
                    from logstore.durable import copies_of

                    holder.hold_copies(node, copies_of(cells, stored))
            except StorageUnavailableError:
                continue  # still down: next time
            except ShardMovedError:
                self.refresh_map()
                continue  # the next pass writes them where the shard went
            except CellConflictError:
                done, bad = self._replay_one_by_one(home, holder, records)
                replayed, failed = replayed + done, failed + bad
                continue
            self._mark_up(node)
            holder.drop_pending([r.id for r in records])
            replayed += len(records)
        return replayed, failed

    def _replay_one_by_one(self, home: NodeRecorder, holder: NodeRecorder,
                           records: list[PendingRecord]) -> tuple[int, int]:
        done = bad = 0
        for record in records:
            try:
                home.insert([record.cell], self._buffer_retry)
            except StorageUnavailableError:
                break  # home went down again: the rest wait for the next pass
            except CellConflictError as exc:
                logger.error("buffered cell of node %s cannot be written home: %s", record.node, exc)
                holder.fail_pending(record.id, str(exc))
                bad += 1
                continue
            holder.drop_pending([record.id])
            done += 1
        return done, bad

    def pending_stats(self) -> dict[str, tuple[int, int]]:
        """(waiting, failed) buffered cells by the node they belong to, summed over the nodes holding them
        that answer (:meth:`pending_counts` says which do not, and who holds what)."""
        return self.pending_counts().by_home()

    def pending_counts(self) -> PendingCounts:
        """Buffered cells by home node and holder. Each node that can hold them is asked once, without
        waiting for one that does not answer (it is named in ``unreachable``); a worker node answers for the
        store behind it, its storage nodes as holders and the ones of them that did not answer as unreachable.

        Raises:
            ConfigurationError: a worker node that cannot tell (a version without ``GET /v1/pending``).
        """
        held: dict[str, dict[str, tuple[int, int]]] = {}
        unreachable: list[str] = []
        for name, recorder in sorted(self._recorders.items()):
            try:
                found = recorder.held_pending(name)
            except StorageUnavailableError as exc:
                logger.info("cannot count the buffered cells on node %s: %s", name, exc)
                unreachable.append(name)
                continue
            for home, holders in found.held.items():
                held.setdefault(home, {}).update(holders)
            unreachable += found.unreachable
        return PendingCounts(held, sorted(set(unreachable)))

    # -- random access ----------------------------------------------------
    def get_cell(self, row_key: uuid.UUID | str, column: str, ref_key: int) -> Cell | None:
        """The cell at (row_key, column, ref_key).

        Args:
            row_key: the row, a UUID (or its text).
            column: the column's name (``_``-prefixed ones too).
            ref_key: the cell's version.

        Returns:
            The cell, or None when there is none.

        Raises:
            InvalidCellError: a row key, column or ref_key that is not valid.
            CorruptCellError: the stored cell cannot be decoded.
            StorageUnavailableError: the storage node did not answer within the retry policy (retriable).
            StorageError: the store is closed, or the node failed otherwise.
        """
        key = coerce_row_key(row_key)
        shard = shard_of(key, self._cluster.shards)
        return self._recorder(shard).get_cell(
            shard, key, check_column(column, allow_reserved=True), check_ref_key(ref_key)
        )

    def get_cell_latest(self, row_key: uuid.UUID | str, column: str, *, as_of: dt.datetime | None = None
                        ) -> Cell | None:
        """The cell of (row_key, column) with the highest ref_key, or None when there is none.

        Args:
            row_key, column: as :meth:`get_cell`'s.
            as_of: a timezone-aware time: the highest ref_key among the versions created at or before it (the
                cell as the store held it then, if no version was written with a lower ref_key later).

        Raises:
            InvalidArgumentError: ``as_of`` not a timezone-aware datetime; otherwise as :meth:`get_cell`'s.
        """
        key = coerce_row_key(row_key)
        shard = shard_of(key, self._cluster.shards)
        name = check_column(column, allow_reserved=True)
        return self._recorder(shard).get_latest(shard, key, name, _check_as_of(as_of))

    def get_cells_latest(self, coordinates: Iterable[tuple[uuid.UUID | str, str]], *,
                         as_of: dt.datetime | None = None) -> list[Cell | None]:
        """The latest cell of each (row_key, column), in the order given: a read per storage node (a statement a
        few hundred on MySQL/MariaDB) where :meth:`get_cell_latest` is one a coordinate.

        Args:
            coordinates: (row_key, column) pairs.
            as_of: as :meth:`get_cell_latest`'s.

        Returns:
            A cell or None (none there) for each coordinate.

        Raises:
            InvalidCellError: a coordinate that is not valid (``index`` says which).
            InvalidArgumentError: ``as_of`` not a timezone-aware datetime; otherwise as :meth:`get_cell`'s.
        """
        return self.read_cells(((r, c, None) for r, c in coordinates), as_of=as_of)

    def get_cells(self, coordinates: Iterable[tuple[uuid.UUID | str, str, int]]) -> list[Cell | None]:
        """The cell at each (row_key, column, ref_key), in the order given: a read per storage node (a statement
        a few hundred on MySQL/MariaDB, one per 500 on SQLite) where :meth:`get_cell` is one a coordinate.

        Returns:
            A cell or None (none there) for each coordinate.

        Raises:
            InvalidCellError: a coordinate that is not valid (``index`` says which); otherwise as
                :meth:`get_cell`'s.
        """
        return self.read_cells(coordinates)

    def read_cells(self, coordinates: Iterable[tuple[uuid.UUID | str, str, int | None]], *,
                   as_of: dt.datetime | None = None, max_bytes: int | None = None) -> list[Cell | None]:
        """The batched read :meth:`get_cells` and :meth:`get_cells_latest` are: the cell of each (row_key, column,
        ref_key), the latest (as of ``as_of``) where ref_key is None, in the order given, a read per storage node.

        Args:
            coordinates: (row_key, column, ref_key or None) triples.
            as_of: the store as it was then: the latest cell created at or before it where ref_key is None (as
                :meth:`get_cell_latest`'s), and None for a named cell created after it.
            max_bytes: the bodies (their MessagePack form) an answer brings at most, as a log page's
                ``max_read_bytes`` (what a worker node answers within); None: every coordinate's cell.

        Returns:
            A cell or None (none there) for each coordinate; when ``max_bytes`` was spent before the last, a
            :class:`~logstore.persistence.TruncatedPage` of the first coordinates' (one at least): read the rest
            in another call.

        Raises:
            InvalidCellError: a coordinate that is not valid (``index`` says which; nothing is read).
            InvalidArgumentError: ``as_of`` or ``max_bytes`` not valid.
            CorruptCellError: a stored cell cannot be decoded.
            StorageUnavailableError: a storage node did not answer within the retry policy (retriable).
            StorageError: the store is closed, or a node failed otherwise.
        """
        at = _check_as_of(as_of)
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
            raise InvalidArgumentError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
        shards = self._cluster.shards
        wanted: list[CellRead] = []
        for i, coordinate in enumerate(coordinates):
            try:
                row_key, column, ref_key = coordinate
                key = coerce_row_key(row_key)
                wanted.append((shard_of(key, shards), key, check_column(column, allow_reserved=True),
                               None if ref_key is None else check_ref_key(ref_key)))
            except InvalidCellError as exc:
                raise InvalidCellError(exc.field, exc.problem, index=i) from None
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"coordinates[{i}] must be a (row_key, column, ref_key) triple, "
                                           f"got {coordinate!r}") from None
        budget = ReadBudget(max_bytes if max_bytes is not None else 1 << 62)  # 2**62: unbounded (see the HTTP client)
        out: list[Cell | None] = [None] * len(wanted)
        todo = list(range(len(wanted)))
        while todo:
            self._fresh_map()
            by_node: dict[str, list[int]] = {}
            for i in todo:
                by_node.setdefault(self._node_of[wanted[i][0]], []).append(i)
            answered: set[int] = set()
            # A pass starts with room left, and its first node (the first coordinate's) answers one coordinate at
            # least: the loop ends.
            for node, indexes in by_node.items():
                if budget.room <= 0:
                    break
                got = self._named(node).read_cells([wanted[i] for i in indexes], at, budget)
                for i, cell in zip(indexes, got, strict=False):
                    # as of a time, a cell written later was not there yet, whether named by ref_key or not
                    out[i] = None if at is not None and cell is not None and cell.created_at > at else cell
                    answered.add(i)
            todo = [i for i in todo if i not in answered]
            if todo and budget.room <= 0:  # spent: the answer is the coordinates before the first not read
                return TruncatedPage(out[:todo[0]])
        return out

    def get_cell_versions(self, row_key: uuid.UUID | str, column: str, *, before: int | None = None,
                          limit: int = 100) -> list[Cell]:
        """A page of the versions of (row_key, column), the highest ref_key first: one indexed read of the
        storage node. Page on with ``before=`` the last ref_key of a page until a page is empty (or not a
        :class:`~logstore.persistence.TruncatedPage` and shorter than ``limit``).

        Args:
            row_key, column: as :meth:`get_cell`'s.
            before: only versions with a lower ref_key (None: from the highest), in [0, 2**63).
            limit: the most versions of the page, in [1, 100000].

        Returns:
            The versions, newest (highest ref_key) first. Their bodies hold to the store's ``max_read_bytes``
            as a log page's: a page cut short is a TruncatedPage (one version at least), and versions follow it.

        Raises:
            InvalidArgumentError: ``before`` or ``limit`` not valid (the message names it); a row key or column
                that is not valid is an InvalidCellError.
            CorruptCellError: a version cannot be decoded.
            StorageUnavailableError: the storage node did not answer within the retry policy (retriable).
            StorageError: the store is closed, or the node failed otherwise.
        """
        key = coerce_row_key(row_key)
        name = check_column(column, allow_reserved=True)
        if before is not None and (type(before) is not int or not 0 <= before < 1 << 63):
            raise InvalidArgumentError(f"before must be a ref_key in [0, 2**63) or None, got {before!r}")
        if type(limit) is not int or not 1 <= limit <= MAX_PAGE:
            raise InvalidArgumentError(f"limit must be an integer in [1, {MAX_PAGE}], got {limit!r}")
        shard = shard_of(key, self._cluster.shards)
        return self._recorder(shard).get_versions(shard, key, name, before, limit,
                                                  ReadBudget(self._options.max_read_bytes))

    def get_row(self, row_key: uuid.UUID | str, *, as_of: dt.datetime | None = None) -> dict[str, Cell]:
        """The latest cell (highest ref_key) of every column of the row, by column name ({} for an unknown row).

        Args:
            row_key: as :meth:`get_cell`'s.
            as_of: as :meth:`get_cell_latest`'s: each column's highest ref_key among its versions created at or
                before it (a column with none then is left out).

        Raises:
            InvalidArgumentError: ``as_of`` not a timezone-aware datetime; otherwise as :meth:`get_cell`'s.
        """
        key = coerce_row_key(row_key)
        shard = shard_of(key, self._cluster.shards)
        at = _check_as_of(as_of)
        return {cell.column: cell for cell in self._recorder(shard).get_row(shard, key, at)}

    # -- log access -------------------------------------------------------
    def get_cells_for_shard(
        self, shard: int, location: int = 0, limit: int = 1000, *, columns: Sequence[str] | None = None
    ) -> tuple[list[Cell], int]:
        """A page of the shard's log: cells with ``added_id > location`` in added_id order, and the location to
        continue from. Paging from the returned location never skips a committed cell.

        Args:
            shard: a shard of the store, in [0, shard_count).
            location: the location to read after (0: from the start; a cell's ``added_id``).
            limit: the most cells of the page, in [1, 100000].
            columns: only cells of these columns when given.

        Returns:
            The cells, and the location to continue from: the last cell's ``added_id``, or ``location`` when
            the page is empty. The page holds ``limit`` cells or reaches the log's end, unless its bodies
            reached the store's ``max_read_bytes``: it is then a :class:`~logstore.persistence.TruncatedPage`
            (one cell at least), and cells follow it.

        Raises:
            InvalidArgumentError: a shard, location, limit or column that is not valid.
            CorruptCellError: the page meets a damaged cell (``cells_before`` holds the good cells before it).
            StorageUnavailableError: the storage node did not answer within the retry policy (retriable).
            StorageError: the store is closed, or the node failed otherwise.
        """
        names = self._check_page(shard, location, limit, columns)
        budget = ReadBudget(self._options.max_read_bytes)
        page = self._recorder(shard).read_logs([(shard, location)], limit, names, False, budget)().get(shard, [])
        if isinstance(page, CorruptCellError):
            raise page
        cells = cast(list[Cell], page)
        return cells, (cells[-1].added_id if cells else location)

    def read_pages(
        self, locations: Mapping[int, int], limit: int = 1000, *, columns: Sequence[str] | None = None,
        packed: bool = False,
    ) -> UndecodedPages:
        """The log pages of many shards, read now (one query per storage node) and decoded by the
        :meth:`~logstore.persistence.UndecodedPages.decode` of what this returns, on the thread that calls it:
        a reader that reads in a worker thread and handles the cells on its event loop decodes them there.
        The one read of many shards: :meth:`get_cells_for_shards` and :meth:`get_packed_cells_for_shards`
        are it, decoded at once.

        Args:
            locations: shard -> the location to read after.
            limit: the most cells of each page, in [1, 100000].
            columns: only cells of these columns when given.
            packed: each body left as its stored MessagePack, decompressed and not decoded
                (:class:`~logstore.cell.PackedCell`), for readers that pass bodies on as MessagePack.

        Returns:
            The undecoded pages; their ``decode()`` gives each shard's page as :meth:`get_cells_for_shard`
            reads it or, for a page that meets a damaged cell, its CorruptCellError (``cells_before`` holds
            the good cells before it), so one bad cell does not hide the other shards' pages. The pages share
            the store's ``max_read_bytes`` of bodies, in the order of ``locations``: once it is spent, each
            page after holds one cell, a :class:`~logstore.persistence.TruncatedPage` when more follow it.

        Raises:
            InvalidArgumentError: a shard, location, limit or column that is not valid (nothing is read).
            StorageUnavailableError: a storage node did not answer within the retry policy (retriable).
            StorageError: the store is closed, or a node failed otherwise.
        """
        names = self._check_reading(limit, columns)  # once, not once per shard
        budget = ReadBudget(self._options.max_read_bytes)
        return UndecodedPages([recorder.read_logs(group, limit, names, packed, budget)
                               for recorder, group in self._locations_by_node(locations)])

    def read_blocks(self, ranges: Mapping[int, tuple[int, int]]) -> dict[int, LogBlock]:
        """Each shard's cells in an id range as one log block (:mod:`logstore.log_blocks`): what a backup
        keeps, the stored bytes as they are, read from each node's primary (never a replica's shorter log).

        Args:
            ranges: shard -> ``(after, up_to)``, the cells with ``after < added_id <= up_to``.

        Returns:
            Each shard's block.

        Raises:
            InvalidArgumentError: a shard or bound that is not valid (nothing is read).
            CorruptCellError: a cell cannot be read.
            StorageUnavailableError: a node's primary did not answer (retriable).
        """
        for _, up_to in ranges.values():
            if type(up_to) is not int or not 0 <= up_to < 1 << 63:
                _bad_location(up_to)
        out: dict[int, LogBlock] = {}
        for recorder, group in self._locations_by_node({s: after for s, (after, _) in ranges.items()}):
            out.update((b.shard, b) for b in recorder.read_blocks([(s, a, ranges[s][1]) for s, a in group]))
        return out

    def get_cells_for_shards(
        self, locations: Mapping[int, int], limit: int = 1000, *, columns: Sequence[str] | None = None
    ) -> dict[int, list[Cell] | CorruptCellError]:
        """:meth:`read_pages`, decoded: each shard's page, or its CorruptCellError. Args and Raises: as
        :meth:`read_pages`'s."""
        return cast("dict[int, list[Cell] | CorruptCellError]",
                    self.read_pages(locations, limit, columns=columns).decode())

    def get_packed_cells_for_shards(
        self, locations: Mapping[int, int], limit: int = 1000, *, columns: Sequence[str] | None = None
    ) -> dict[int, list[PackedCell] | CorruptCellError]:
        """:meth:`read_pages` with ``packed``, decoded: each shard's page of
        :class:`~logstore.cell.PackedCell`, or its CorruptCellError. Args and Raises: as :meth:`read_pages`'s."""
        return cast("dict[int, list[PackedCell] | CorruptCellError]",
                    self.read_pages(locations, limit, columns=columns, packed=True).decode())

    def _check_page(self, shard: int, location: int, limit: int, columns: Sequence[str] | None) -> list[str] | None:
        self.check_shard(shard)
        if type(location) is not int or not 0 <= location < 1 << 63:
            _bad_location(location)
        return self._check_reading(limit, columns)

    @staticmethod
    def _check_reading(limit: int, columns: Sequence[str] | None) -> list[str] | None:
        if type(limit) is not int or not 1 <= limit <= MAX_PAGE:
            raise InvalidArgumentError(f"limit must be an integer in [1, {MAX_PAGE}], got {limit!r}")
        if isinstance(columns, str):
            raise InvalidArgumentError("columns must be a list of column names, not one string")
        return [check_column(c, allow_reserved=True) for c in columns] if columns else None

    def location_at(self, shard: int, when: dt.datetime) -> int:
        """A location from which paging yields every cell created at or after ``when``.

        ``when`` must be timezone-aware. If no cell is that recent, the shard's head.
        """
        self.check_shard(shard)
        utc = _utc(when, "location_at")
        recorder = self._recorder(shard)
        # The head is read first: a cell committed between the two reads has a higher
        # id than this head, so falling back to it can never skip that cell.
        head = recorder.head(shard)
        first = recorder.first_at(shard, utc)
        return first - 1 if first is not None else head

    def locations_at(self, when: dt.datetime, shards: Iterable[int] | None = None) -> dict[int, int]:
        """:meth:`location_at` of many shards (default: all): the heads, then the first cells that recent, a
        few reads per storage node.

        Raises:
            InvalidArgumentError: ``when`` is naive or a shard is out of range.
            StorageError: a storage node cannot be read.
        """
        wanted = range(self.shard_count) if shards is None else sorted({self.check_shard(s) for s in shards})
        utc = _utc(when, "locations_at")
        heads = self.heads(wanted)  # first, as location_at: a cell committed between the reads is not skipped
        firsts: dict[int, int] = {}
        for node, group in self._by_node(wanted).items():
            firsts.update(self._named(node).firsts_at(list(wanted) if group is None else group, utc))
        return {shard: firsts[shard] - 1 if shard in firsts else heads[shard] for shard in wanted}

    def count_after(self, shard: int, location: int, *, columns: Sequence[str] | None = None,
                    reserved: bool = True) -> int:
        """How many cells of the shard (of ``columns`` if given) lie after ``location``: a reader's lag in cells.
        ``reserved=False`` leaves cellstream's own columns (``_job``, ``_index``...) out: a reader of every
        column passes over them."""
        names = self._check_page(shard, location, 1, columns)
        return self._recorder(shard).count_after(shard, location, names, reserved)

    def counts_after(self, locations: Mapping[int, int], *, columns: Sequence[str] | None = None,
                     reserved: bool = True) -> dict[int, int]:
        """``count_after`` of many shards (shard -> location), a few reads per storage node: the lag of a
        reader of thousands of shards without a read per shard."""
        names = self._check_reading(1, columns)
        out: dict[int, int] = {}
        for recorder, group in self._locations_by_node(locations):
            out.update(recorder.counts_after(group, names, reserved))
        return out

    def head(self, shard: int) -> int:
        """The highest added_id of the shard (0 when empty): the location of the log's end."""
        return self._recorder(self.check_shard(shard)).head(shard)

    def heads(self, shards: Iterable[int] | None = None) -> dict[int, int]:
        """The head of each of ``shards`` (default: all), one read per storage node where the backend can:
        a reader's lag over many shards without a read per shard."""
        wanted = range(self.shard_count) if shards is None else sorted({self.check_shard(s) for s in shards})
        out: dict[int, int] = {}
        for node, group in self._by_node(wanted).items():
            out.update(self._named(node).heads(wanted if group is None else group))
        return {s: out.get(s, 0) for s in wanted}

    def shard_stats(self) -> list[ShardInfo]:
        """Cells per shard and the node holding it, for every shard (the shard map read afresh)."""
        self.refresh_map()
        counts = self.cell_counts()
        return [ShardInfo(s, node, counts[s]) for s, node in enumerate(self._node_of)]

    def shard_weights(self, by: str = "cells", *, window: float = 3600.0) -> dict[int, int]:
        """Every shard's weight for a rebalance plan, counted on the node holding it (the shard map read afresh).

        Args:
            by: ``"cells"`` (its log's length), ``"bytes"`` (its cells' bodies as stored, and keys) or
                ``"writes"`` (cells added in the last ``window`` seconds).
            window: the span of ``"writes"``, seconds.

        Returns:
            shard -> weight, for every shard.

        Raises:
            InvalidArgumentError: another ``by``, or a window that is not positive.
            ConfigurationError: a node whose backend cannot weigh its shards that way.
        """
        if by not in ("cells", "bytes", "writes"):
            raise InvalidArgumentError(f"shards are weighed by cells, bytes or writes, not {by!r}")
        if not window > 0:
            raise InvalidArgumentError(f"the window of recent writes must be positive seconds, got {window!r}")
        self.refresh_map()
        if by == "cells":
            return self.cell_counts()
        found: dict[str, dict[int, int]] = {}
        for node in dict.fromkeys(self._node_of):
            weights = self._named(node).shard_weights(by, window)
            if weights is None:
                raise ConfigurationError(f"storage node {node} cannot weigh its shards by {by}")
            found[node] = weights
        return {s: found[node].get(s, 0) for s, node in enumerate(self._node_of)}

    def cell_counts(self) -> dict[int, int]:
        """Cells per shard for every shard: one read per storage node, and the shard map only when
        ``map_refresh`` has passed: cheaper than :meth:`shard_stats`, which also reads the moves and builds a
        record per shard."""
        return self.changed_counts().counts

    def changed_counts(self, since: object | None = None) -> ChangedCounts:
        """Cells per shard of the shards whose count may have moved since ``since`` (the mark of an earlier
        answer), and the mark for the next call: what a reader looks at to find the shards that moved.

        Without a mark, every shard's (``complete``); so too after the shard map changed, and from nodes
        that cannot tell which shards moved. A partial answer costs in proportion to the shards written
        lately, not to the shard count. On MySQL/MariaDB it may leave out a shard whose writer held its
        transaction open longer than a margin (0.2 s), so a reader relying on partial answers takes a
        complete one now and then (the tailer: twice a second); SQLite's are exact (one writer at a time).
        """
        self._recorder(0)  # closed check, and the shard map refreshed when it is due
        changes = self._map_changes
        marks: dict[str, object | None] = {}
        if isinstance(since, CountsMark) and since.map_changes == changes:
            marks = since.nodes
        answers = {name: recorder.changed_counts(marks.get(name)) for name, recorder in self._recorders.items()}
        mark = CountsMark(changes, {name: answer.mark for name, answer in answers.items()})
        complete = all(answer.complete for answer in answers.values())
        if complete and len(answers) == 1:
            [only] = (answer.counts for answer in answers.values())
            if len(only) != self.shard_count:
                only = {s: only.get(s, 0) for s in range(self.shard_count)}
            return ChangedCounts(only, mark, True)
        if complete:
            counts = {s: answers[node].counts.get(s, 0) if node in answers else 0
                      for s, node in enumerate(self._node_of)}
        elif len(answers) == 1:  # the only node holds every shard
            [counts] = (answer.counts for answer in answers.values())
        else:  # each shard's count from the node the map says holds it
            node_of = self._node_of
            counts = {s: n for name, answer in answers.items() for s, n in answer.counts.items()
                      if 0 <= s < len(node_of) and node_of[s] == name}
        return ChangedCounts(counts, mark, complete)

    # -- consumer offsets ---------------------------------------------------
    def claim_offsets(self, consumer: str, owner: str, shards: Iterable[int] | None = None) -> dict[int, OffsetRecord]:
        """Make ``owner`` the holder of the consumer's positions in ``shards`` (default: all).

        Commits by the previous holder are refused from then on (see commit_offsets). A shard that a move
        fenced is claimed where the move takes it, once its switch is recorded (as a write waits for it).
        """
        wanted = range(self.shard_count) if shards is None else sorted({self.check_shard(s) for s in shards})
        self._check_consumer(consumer, owner)
        out: dict[int, OffsetRecord] = {}
        todo: Sequence[int] = wanted
        for attempt in range(_MOVE_HOPS):
            moved: list[int] = []
            for node, group in self._by_node(todo).items():
                try:
                    records = self._named(node).claim_offsets(consumer, owner, todo if group is None else group)
                except ShardMovedError as exc:
                    if attempt == _MOVE_HOPS - 1:
                        raise
                    logger.info("%s: claiming its offsets after reloading the shard map", exc)
                    moved.extend(todo if group is None else group)  # the node claimed none of them
                    continue
                out.update(zip([r.shard for r in records], records, strict=True))
            if not moved:
                break
            self._follow_moves(attempt)
            todo = moved
        return out

    def commit_offsets(self, consumer: str, owner: str, offsets: Mapping[int, tuple[int, dict[str, Any]]]) -> set[int]:
        """Store (location, doc) per shard while ``owner`` holds it; return the shards it no longer holds.

        Atomic per storage node. ``doc`` is a small JSON object kept beside the location.
        """
        self._check_consumer(consumer, owner)
        rows: dict[int, tuple[int, str]] = {}
        # Encoded once per doc object: a coordinator's shards mostly share one (nothing dead-lettered, no
        # error), and a commit of 4096 shards spent more on encoding docs than on writing them. (By id: every
        # doc is alive, held by ``offsets``, until this returns.)
        encoded: dict[int, str] = {}
        shards = self._cluster.shards
        for shard, (location, doc) in offsets.items():
            if type(shard) is not int or not 0 <= shard < shards:
                self.check_shard(shard)  # raises, naming it
            if type(location) is not int or not 0 <= location < 1 << 63:
                _bad_location(location)
            text = encoded.get(id(doc))
            if text is None:
                text = encoded[id(doc)] = offset_doc(doc)
            rows[shard] = (location, text)
        fenced: set[int] = set()
        for node, group in self._by_node(rows).items():
            fenced |= self._named(node).commit_offsets(consumer, owner, rows if group is None else
                                                           {s: rows[s] for s in group})
        return fenced

    def check_direct(self, what: str) -> None:
        """Refuse ``what`` (a backup, a restore, a mirror) when a storage node is reached through a worker node.

        Raises:
            ConfigurationError: naming the node, and the way that works.
        """
        for node in self.nodes:
            if not self._named(node).supports_backup:
                raise ConfigurationError(f"storage node {node} is a worker node's: {what} goes through the store's "
                                         "URL or cluster file, not a worker node")

    def consumers(self) -> list[str]:
        """The names of the consumers with offsets on any storage node, sorted.

        Raises:
            StorageError: a storage node cannot be read.
        """
        names: set[str] = set()
        for node in self.nodes:
            names.update(self._named(node).consumers())
        return sorted(names)

    def read_offsets(self, consumer: str) -> dict[int, OffsetRecord]:
        """Every committed position of ``consumer``, by shard: a shard's from the node the map puts it on where
        a move left an older one on its source."""
        self._check_consumer(consumer, "-")
        out: dict[int, OffsetRecord] = {}
        node_of = self._node_of
        for name, recorder in self._recorders.items():
            for record in recorder.read_offsets(consumer):
                shard = record.shard
                if shard not in out or (0 <= shard < len(node_of) and node_of[shard] == name):
                    out[shard] = record
        return out

    def _by_node(self, shards: Iterable[int]) -> dict[str, list[int] | None]:
        """``shards`` by the node holding them; None for all of them, in a store of one node (no pass over the
        thousands of shards of a claim or a commit)."""
        if self._closed:
            raise StorageError("the store is closed")
        if len(self._recorders) == 1:
            return dict.fromkeys(self._recorders)
        groups: dict[str, list[int]] = {}
        for shard in shards:
            groups.setdefault(self._node_of[shard], []).append(shard)
        return dict(groups)

    @staticmethod
    def _check_consumer(consumer: object, owner: object) -> None:
        for what, value in (("consumer", consumer), ("owner", owner)):
            if not isinstance(value, str) or not 1 <= len(value) <= 200 or not value.isprintable():
                raise InvalidArgumentError(f"{what} must be 1-200 printable characters, got {value!r}")

    # -- lifecycle --------------------------------------------------------
    def close(self) -> None:
        """Close every connection. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        for recorder in [*self._recorders.values(), *self._retired]:
            recorder.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        nodes = ", ".join(f"{n.name}={n.target.redacted()}[{n.shards or 'joined'}]" for n in self._cluster.nodes)
        return f"<logstore.Store shards={self._cluster.shards} {nodes}>"


def _check_as_of(as_of: object) -> dt.datetime | None:
    """``as_of`` in UTC (None stays None); a time before year 1 or after 9999 in UTC is before, or after, every
    cell."""
    if as_of is None:
        return None
    if not isinstance(as_of, dt.datetime) or as_of.tzinfo is None or as_of.utcoffset() is None:
        raise InvalidArgumentError(f"as_of must be a timezone-aware datetime, got {as_of!r}")
    try:
        return as_of.astimezone(dt.UTC)
    except OverflowError:
        return (dt.datetime.min if as_of.year == 1 else dt.datetime.max).replace(tzinfo=dt.UTC)


def _utc(when: object, what: str) -> dt.datetime:
    """``when`` in UTC, or InvalidArgumentError naming ``what`` needs an aware datetime in range."""
    if not isinstance(when, dt.datetime) or when.tzinfo is None or when.utcoffset() is None:
        raise InvalidArgumentError(f"{what} needs a timezone-aware datetime")
    try:
        return when.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidArgumentError(f"{when.isoformat()} is out of range in UTC") from None


def _bad_location(location: object) -> NoReturn:
    raise InvalidArgumentError(f"location must be an integer in [0, 2^63), got {location!r}")


def node_meta(cluster: ClusterConfig, node: NodeConfig) -> NodeMeta:
    return NodeMeta(cluster.shards, node.first, node.last)


class _IndexRouter:
    """The store as the index tables see it (:class:`logstore.index_tables.store.ShardRouter`)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.shard_count = store.shard_count

    @property
    def recorders(self) -> Sequence[IndexRecorder]:
        """Every node's index tables, as the map has the nodes now."""
        return [r.indexes for r in self._store._recorders.values()]

    def check_shard(self, shard: object) -> int:
        return self._store.check_shard(shard)

    def shard_of(self, row_key: uuid.UUID | str) -> int:
        return self._store.shard_of(row_key)

    def recorder_of(self, shard: int) -> IndexRecorder:
        return self._store._recorder(shard).indexes

    def holdings(self) -> Sequence[tuple[IndexRecorder, Sequence[int] | None]]:
        store = self._store
        store._fresh_map()
        recorders = store._recorders
        if not store._movable:
            return [(r.indexes, None) for r in recorders.values()]
        held: dict[str, list[int]] = {name: [] for name in recorders}
        for shard, name in enumerate(store.placement()):
            if name not in held:  # its shards would go unread
                raise StorageUnavailableError(f"storage node {name} of the shard map is not open in this process")
            held[name].append(shard)
        return [(recorders[name].indexes, shards) for name, shards in held.items()]

    def refresh_map(self) -> None:
        self._store.refresh_map()
