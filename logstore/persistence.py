"""What every storage backend implements, and the logic they share.

A *node recorder* stores a contiguous range of shards on one storage node (a
SQLite directory or a MySQL database). The :class:`~logstore.store.Store` above it
validates and encodes cells, routes them by shard and never sees SQL.

Contract every recorder keeps (tests/contracts/logstore_contract.py checks it on each one):
- ``insert`` is atomic for the node: either every given cell is stored (or was
  already stored with an identical body) or nothing changes.
- Within a shard, ``added_id`` is strictly increasing in commit order. A reader
  paging ``added_id > location`` therefore never misses a committed cell: writes
  to a shard are serialized by a per-shard lock taken before ids are allocated,
  so no transaction can commit an id below one already visible.
"""

from __future__ import annotations

import datetime as dt
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar, cast

import msgpack

from logstore.cell import AnyCell, Cell, PackedCell, compress, inflate_body, same_json, unpack_body, unpack_map
from logstore.errors import CellConflictError, ConfigurationError, CorruptCellError, StorageError
from logstore.index_tables.persistence import IndexEntry, IndexRecorder, Order
from logstore.index_tables.query import IndexInfo
from logstore.log_blocks import BlockCell, LogBlock, created_text
from logstore.log_blocks import encode as encode_block
from logstore.offsets import OffsetRecord
from logstore.retry import RetryPolicy

FORMAT_VERSION = 1
_BLOCK_PAGE = 5000  # cells a page of the default read_blocks
_BLOCK_LEVEL = 6  # zlib's default: the stored bytes of a backend that cannot give its own
Coordinates = tuple[bytes, str, int]
# A coordinate of a batched read: (shard, row key, column, ref_key), a ref_key of None for the latest.
CellRead = tuple[int, uuid.UUID, str, int | None]
R = TypeVar("R")
C = TypeVar("C", bound=AnyCell)
_Item = TypeVar("_Item")  # of a TruncatedPage: a log page's cells, or a batched read's (cells or None)


class PendingCell(NamedTuple):
    """A validated cell on its way in: coordinates, decoded body and stored bytes."""

    shard: int
    row_key: uuid.UUID
    column: str
    ref_key: int
    body: dict[str, Any]
    blob: bytes

    @property
    def coordinates(self) -> Coordinates:
        return (self.row_key.bytes, self.column, self.ref_key)


class PendingRecord(NamedTuple):
    """A cell of storage node ``node`` buffered on another node while ``node``'s primary was unavailable;
    ``failed`` says why it could not be written home for good (None while it waits)."""

    id: int
    node: str
    cell: PendingCell
    failed: str | None


class PendingReport(NamedTuple):
    """What one :meth:`Store.replay_pending` pass did."""

    replayed: int
    failed: int
    waiting: int
    unreachable: list[str]  # nodes holding buffered cells that did not answer: their cells wait too


class PendingCounts(NamedTuple):
    """Buffered cells by the node they belong to (their home) and the node holding them meanwhile:
    ``held[home][holder] = (waiting, failed)``. A holder in ``unreachable`` did not answer: what it holds
    is not counted."""

    held: dict[str, dict[str, tuple[int, int]]]
    unreachable: list[str]

    def by_home(self) -> dict[str, tuple[int, int]]:
        return {home: (sum(w for w, _ in holders.values()), sum(f for _, f in holders.values()))
                for home, holders in self.held.items()}


class RestoredCell(NamedTuple):
    """A cell of a backup on its way back in (:mod:`logstore.backup.restore`): its coordinates, stored bytes
    (``blob``, as :class:`PendingCell`'s), and the ``added_id`` and ``created_at`` it had in the source."""

    shard: int
    added_id: int
    row_key: uuid.UUID
    column: str
    ref_key: int
    blob: bytes
    created_at: dt.datetime


class NodeMeta(NamedTuple):
    """What a node records about the instance it belongs to."""

    shard_count: int
    first: int
    last: int


class ChangedCounts(NamedTuple):
    """The cell counts a reader looks at to find the shards that moved (see ``changed_counts``)."""

    counts: dict[int, int]  # cells per shard: every shard's when complete, else those that may have moved
    mark: object | None  # handed to the next call; None: the next answer is complete
    complete: bool


class NodeRecorder(ABC):
    """One storage node's shards. Implementations are safe to share between threads."""

    #: Fault injection for tests: called inside every write transaction, with the
    #: shards it writes, after the cells are inserted and before COMMIT.
    before_commit: Callable[[Sequence[int]], None] | None = None
    #: The node's index tables (logstore.index_tables.persistence).
    indexes: IndexRecorder
    #: Reads of the node's logs worth running at once from one process: a server answers several while
    #: the process decodes pages; an embedded database's reads run in the process, on its CPU and GIL.
    parallel_reads = 4
    #: Write transactions of one process worth running at once (of different shards): a server overlaps one's
    #: statements with another's commit; an embedded database has one writer.
    parallel_writes = 2

    @abstractmethod
    def read_meta(self, retry: RetryPolicy | None = None) -> NodeMeta | None:
        """The node's recorded metadata, or None when the node was never initialized. ``retry`` replaces the
        store's policy (a cluster does not wait long for one node when it opens)."""

    def defer_initialize(self, meta: NodeMeta) -> None:
        """Initialize later, before the first statement that reaches the node (it did not answer at open).
        Only a backend whose node can be down while the store is usable overrides this."""
        raise ConfigurationError(f"storage node {getattr(self, 'name', '?')} must answer when the store opens")

    @abstractmethod
    def initialize(self, meta: NodeMeta, retry: RetryPolicy | None = None) -> None:
        """Create the node's schema and metadata if missing; raise ConfigurationError on mismatch."""

    @abstractmethod
    def insert(self, cells: Sequence[PendingCell], retry: RetryPolicy | None = None) -> list[Cell]:
        """Store ``cells`` atomically; return the stored cell for each, in order. ``retry`` replaces the
        store's policy for this call (a write about to be buffered elsewhere waits less)."""

    def restore_cells(self, cells: Sequence[RestoredCell]) -> None:
        """Write ``cells`` with their given ``added_id`` and ``created_at`` (a restore, :mod:`logstore.backup`),
        atomically, and move each shard's counter past them so later writes continue above. Each cell's id must
        be above its shard's head: a restore writes a shard's cells in id order into a shard that holds none
        below them, so no id ever names two cells.

        Raises:
            StorageError: an id not above its shard's head, or coordinates already stored (nothing written).
            ConfigurationError: the backend cannot restore cells.
        """
        raise ConfigurationError(f"storage node {getattr(self, 'name', '?')} cannot restore cells: restore into "
                                 "a SQLite or MySQL/MariaDB instance")

    # -- shard moves (logstore.backends.mysql.moves): only nodes that can give and take shards override these --
    supports_moves = False

    def moves(self) -> dict[int, str]:
        """Shards moved away from this node, and the node each went to."""
        return {}

    def stored_bytes(self) -> int | None:
        """The bytes the node's tables take on disk, data and indexes (None when the backend cannot tell)."""
        return None

    def shard_weights(self, by: str, window: float) -> dict[int, int] | None:
        """Each shard's weight on this node, for a rebalance plan: ``"bytes"``, the bytes of its cells (bodies
        as stored, and keys), or ``"writes"``, the cells added in the last ``window`` seconds. Shards the node
        holds rows of and no longer owns are in it too (the store keeps the owner's). None when the backend
        cannot tell."""
        return None

    def read_map(self) -> tuple[int, str] | None:
        """The newest version of the shard map (:mod:`logstore.shard_map`) the node holds, and its JSON document;
        None when it holds none. Answers at once or raises StorageUnavailableError."""
        return None

    def write_map(self, version: int, doc: str) -> bool:
        """Record a version of the shard map; False when the node holds that version already."""
        raise ConfigurationError(f"storage node {getattr(self, 'name', '?')} keeps no shard map: its store is a "
                                 "single-node one")

    # -- buffered writes: only nodes that can hold other nodes' cells override these --------
    supports_pending = False

    def buffer(self, node: str, cells: Sequence[PendingCell]) -> None:
        """Keep ``cells`` of storage node ``node`` until they are written home (idempotent)."""
        raise StorageError(f"storage node {getattr(self, 'name', '?')} cannot hold other nodes' writes")

    def pending(self, limit: int) -> list[PendingRecord]:
        """Buffered cells waiting to go home, oldest first."""
        return []

    def drop_pending(self, ids: Sequence[int]) -> None:  # noqa: B027
        """Forget buffered cells written home."""

    def fail_pending(self, pid: int, reason: str) -> None:  # noqa: B027
        """Keep a buffered cell that cannot go home, with why (for triage)."""

    def pending_counts(self) -> dict[str, tuple[int, int]]:
        """(waiting, failed) buffered cells by the node they belong to."""
        return {}

    def held_pending(self, name: str) -> PendingCounts:
        """The buffered cells this node can tell of, by home and holder: those it holds itself (as holder
        ``name``, its name in the store), or, for a node in front of a whole store (a worker node), that
        store's. One look, no waiting.

        Raises:
            StorageUnavailableError: the node does not answer.
            ConfigurationError: the node cannot tell (a worker node of a version without the route).
        """
        if not self.supports_pending:
            return PendingCounts({}, [])
        return PendingCounts({home: {name: counts} for home, counts in self.pending_counts().items()}, [])

    def replay_behind(self) -> PendingReport | None:
        """For a node in front of a whole store (a worker node): one replay pass of that store's buffered
        writes, run there (:meth:`Store.replay_pending`). None for a storage node: its buffered cells are
        replayed by the store holding it.

        Raises:
            StorageUnavailableError: the node does not answer.
        """
        return None

    def burn_ids(self, burn: int) -> int:
        """Make each shard the node holds skip ``burn`` ids from its head on (its ``id_floor``); the shards
        changed.

        Raises:
            ConfigurationError: the backend cannot skip ids (SQLite numbers cells per node, not per shard).
        """
        raise ConfigurationError(f"storage node {getattr(self, 'name', '?')} cannot skip ids: its cells are "
                                 "numbered per node, not per shard")

    # -- markers: a named value kept with the node's metadata (a standby mirror's ``mirror_of``) --------
    def read_marker(self, name: str) -> str | None:
        """The node's marker ``name``; None when it has none."""
        return None

    def write_marker(self, name: str, value: str | None) -> None:
        """Set the node's marker ``name`` (None: remove it)."""
        raise ConfigurationError(f"storage node {getattr(self, 'name', '?')} keeps no markers")

    # -- durable copies (durable buffered writes): only nodes that can hold them override these --------
    @property
    def replicated(self) -> bool:
        """Whether the node has replicas: only then are its writes held as durable copies (a node without one
        has no replica to promote)."""
        return False

    def hold_copies(self, home: str, cells: Sequence[RestoredCell]) -> None:
        """Keep copies of ``cells``, acknowledged by node ``home``'s primary, until its replicas hold them."""
        raise StorageError(f"storage node {getattr(self, 'name', '?')} cannot hold other nodes' copies")

    def trim_copies(self, home: str, heads: Mapping[int, int]) -> int:
        """Drop the copies of ``home``'s cells up to ``heads`` (shard -> id its replicas hold); the count."""
        return 0

    def copies_above(self, home: str, heads: Mapping[int, int]) -> list[RestoredCell]:
        """The copies of ``home``'s cells above ``heads``, by shard and id."""
        return []

    def copy_counts(self) -> dict[str, int]:
        """Copies held, by home node."""
        return {}

    def replica_heads(self) -> dict[int, int] | None:
        """Each shard's counter as every replica of the node holds it (the lowest of them); None when the node
        has no replica. Raises StorageUnavailableError when a replica does not answer."""
        return None

    @abstractmethod
    def get_cell(self, shard: int, row_key: uuid.UUID, column: str, ref_key: int) -> Cell | None: ...

    @abstractmethod
    def get_latest(self, shard: int, row_key: uuid.UUID, column: str, as_of: dt.datetime | None = None) -> Cell | None:
        """The cell of the highest ref_key, among those created at or before ``as_of`` (UTC) when given."""

    def read_cells(self, coordinates: Sequence[CellRead], as_of: dt.datetime | None,
                   budget: ReadBudget) -> list[Cell | None]:
        """Each coordinate's cell, in the order given (None: there is none): with a ref_key the cell at it, without
        one the latest (:meth:`get_latest`, as of ``as_of``). The bodies draw on ``budget`` in that order: once it
        is spent the answer ends with the cell that spent it, a :class:`TruncatedPage` shorter than
        ``coordinates`` (one coordinate answered at least). Here a read each; a backend that can reads many in one
        statement."""
        out: list[Cell | None] = []
        for i, (shard, row_key, column, ref_key) in enumerate(coordinates):
            if budget.room <= 0 and i:
                return TruncatedPage(out)
            cell = (self.get_latest(shard, row_key, column, as_of) if ref_key is None
                    else self.get_cell(shard, row_key, column, ref_key))
            if cell is not None:
                budget.room -= len(msgpack.packb(cell.body))
            out.append(cell)
        return out

    @abstractmethod
    def get_versions(self, shard: int, row_key: uuid.UUID, column: str, before: int | None, limit: int,
                     budget: ReadBudget) -> list[Cell]:
        """The cell's versions with ``ref_key < before`` (all when None), the highest ref_key first, at most
        ``limit``; their bodies draw on ``budget``: once it is spent the page ends with the cell that spent it, a
        :class:`TruncatedPage` when more versions follow (:func:`decode_log`)."""

    @abstractmethod
    def get_row(self, shard: int, row_key: uuid.UUID, as_of: dt.datetime | None = None) -> list[Cell]:
        """The highest-ref_key cell of every column of the row, among those created at or before ``as_of`` (UTC)
        when given."""

    @abstractmethod
    def read_logs(
        self, locations: Sequence[tuple[int, int]], limit: int, columns: Sequence[str] | None, packed: bool,
        budget: ReadBudget,
    ) -> Callable[[], Mapping[int, Sequence[AnyCell] | CorruptCellError]]:
        """The log pages of several shards of this node, read now, and a function that decodes them (on the
        thread that calls it, see :class:`UndecodedPages`): the one read of the logs a backend implements.

        Args:
            locations: (shard, location) pairs, each shard once, all of this node.
            limit: the most cells of a page.
            columns: only cells of these columns when given.
            packed: bodies left as MessagePack (:class:`~logstore.cell.PackedCell`), else decoded
                (:class:`~logstore.cell.Cell`).
            budget: the bytes of bodies the read may bring, which its pages draw on as they are decoded.

        Returns:
            The decoder, whose answer holds every shard of ``locations``: its cells with
            ``added_id > location`` in added_id order, up to ``limit``, and cut short as a
            :class:`TruncatedPage` after the cell that spends ``budget`` (:func:`decode_pages` does both,
            inflating each body within the store's ``inflate_limit``); or, when the page meets a damaged cell,
            its CorruptCellError with the good cells before it in ``cells_before`` (the other pages still
            arrive). A backend that cannot read apart from decoding returns pages decoded already.
        """

    def read_blocks(self, ranges: Sequence[tuple[int, int, int]]) -> list[LogBlock]:
        """Each ``(shard, after, up_to)`` range's cells, ``after < added_id <= up_to``, as a log block
        (:mod:`logstore.log_blocks`), read from the primary only: a backup must not take a replica's shorter
        log for the whole. This default reads pages through :meth:`read_logs` and compresses each body again;
        a backend that keeps the stored bytes at hand overrides it.

        Raises:
            CorruptCellError: a cell of a range cannot be read.
            StorageUnavailableError: the node did not answer (retriable).
        """
        out: list[LogBlock] = []
        for shard, after, up_to in ranges:
            cells: list[BlockCell] = []
            while after < up_to:
                page = self.read_logs([(shard, after)], _BLOCK_PAGE, None, True, ReadBudget(1 << 62))()
                found = page.get(shard, [])
                if isinstance(found, CorruptCellError):
                    raise found
                kept = [c for c in cast("Sequence[PackedCell]", found) if c.added_id <= up_to]
                cells += [BlockCell(c.added_id, created_text(c.created_at), c.ref_key, c.column, c.row_key.bytes,
                                    compress(c.packed, _BLOCK_LEVEL)) for c in kept]
                if len(kept) < len(found) or len(found) < _BLOCK_PAGE:
                    break
                after = found[-1].added_id
            out.append(LogBlock(shard, len(cells), encode_block(cells)))
        return out

    @abstractmethod
    def first_at(self, shard: int, when: dt.datetime) -> int | None:
        """The lowest added_id created at or after ``when`` (UTC), or None."""

    def firsts_at(self, shards: Sequence[int], when: dt.datetime) -> dict[int, int]:
        """:meth:`first_at` of many shards: those with a cell that recent (a backend batches the reads)."""
        return {shard: first for shard in shards if (first := self.first_at(shard, when)) is not None}

    @abstractmethod
    def head(self, shard: int) -> int:
        """The highest added_id of the shard, 0 when empty."""

    def heads(self, shards: Sequence[int]) -> dict[int, int]:
        """``head`` of each of ``shards``; backends with a cheaper way than a read per shard override this."""
        return {shard: self.head(shard) for shard in shards}

    @abstractmethod
    def count_after(self, shard: int, location: int, columns: Sequence[str] | None = None,
                    reserved: bool = True) -> int:
        """How many cells of the shard (of ``columns`` if given; without cellstream's own columns, those
        starting with ``_``, unless ``reserved``) have ``added_id > location``."""

    def counts_after(self, locations: Sequence[tuple[int, int]],
                     columns: Sequence[str] | None = None, reserved: bool = True) -> dict[int, int]:
        """``count_after`` of several shards of this node (shard, location pairs); backends with a cheaper
        way than a read per shard override this."""
        return {shard: self.count_after(shard, location, columns, reserved) for shard, location in locations}

    @abstractmethod
    def shard_counts(self) -> dict[int, int]:
        """Cells per shard, for every shard of the node."""

    def changed_counts(self, since: object | None) -> ChangedCounts:
        """Cells per shard of the shards whose count may have moved since ``since`` (the mark of an earlier
        answer), and the mark for the next call; every shard's without a mark, and on backends that cannot
        tell which moved. A partial answer may leave out a shard whose writer held its transaction open
        longer than the backend's margin: a reader that relies on them counts every shard now and then.

        A mark is made of JSON's values (tuples for arrays; a worker node sends it to its clients and back),
        and ``since`` may be anything: what is not a mark of this backend gets every shard's count."""
        return ChangedCounts(self.shard_counts(), None, True)

    # Consumer offsets: the one mutable table. A consumer (a tailer or an app) keeps
    # its position per shard on the node holding the shard, all of a node's in one row
    # (logstore.offsets); each shard's owner fences a process that lost the shard to
    # another (its commits change nothing).
    @abstractmethod
    def claim_offsets(self, consumer: str, owner: str, shards: Sequence[int]) -> list[OffsetRecord]:
        """Make ``owner`` the holder of the consumer's offsets of ``shards`` (creating them); return them."""

    @abstractmethod
    def commit_offsets(self, consumer: str, owner: str, offsets: dict[int, tuple[int, str]]) -> set[int]:
        """Store (location, JSON doc) per shard where ``owner`` still holds it, atomically; return the
        shards another owner holds (fenced)."""

    @abstractmethod
    def read_offsets(self, consumer: str) -> list[OffsetRecord]: ...

    #: Whether backups, restores and mirrors may go through this recorder: they read and write a node's
    #: tables whole, which a worker node's client does not offer.
    supports_backup: ClassVar[bool] = True

    #: Whether the node behind this recorder answers index queries itself (a worker node reads its catalog and
    #: index tables): the store then asks it with :meth:`query_index` rather than reading ``indexes``.
    answers_index_queries: ClassVar[bool] = False

    def query_index(self, name: str, where: Mapping[str, Any], *, order: Order, limit: int, scatter: bool,
                    version: int | None) -> list[IndexEntry]:
        """Entries of index ``name`` as the node answers them (``logstore.index_tables.query.query_index``), for a
        recorder that :attr:`answers_index_queries`; a storage node's recorder does not (its ``indexes`` are read).

        Raises:
            ConfigurationError: this recorder does not answer index queries.
        """
        raise ConfigurationError(f"storage node {getattr(self, 'name', '?')} does not answer index queries: the "
                                 "store reads its index tables")

    def index_info(self, name: str) -> IndexInfo:
        """Index ``name`` as the catalog of the node behind this recorder has it (see :meth:`query_index`).

        Raises:
            IndexUnknownError: no index of that name.
            ConfigurationError: this recorder does not answer index queries.
        """
        raise ConfigurationError(f"storage node {getattr(self, 'name', '?')} does not answer index queries: the "
                                 "store reads its index catalog")

    @abstractmethod
    def consumers(self) -> list[str]:
        """The names of the consumers with offsets on this node, sorted."""

    @abstractmethod
    def close(self) -> None: ...


def check_meta(node: str, found: NodeMeta, wanted: NodeMeta) -> None:
    if found.shard_count != wanted.shard_count:
        raise ConfigurationError(
            f"storage node {node} was created with {found.shard_count} shards, "
            f"opened with {wanted.shard_count}; the shard count is fixed at creation"
        )
    if (found.first, found.last) != (wanted.first, wanted.last):
        raise ConfigurationError(
            f"storage node {node} holds shards {found.first}-{found.last}, "
            f"the configuration gives it {wanted.first}-{wanted.last}"
        )


_new_object = object.__new__
_new_tuple = tuple.__new__  # a NamedTuple's own __new__ is a Python-level function: twice as slow, per cell
_set = object.__setattr__
_UNKNOWN = uuid.SafeUUID.unknown  # an enum member: looked up once, not per key


def concat_counts(shards: str | None, cells: str | None) -> dict[int, int]:
    """Cells per shard from one row of two comma-separated lists (GROUP_CONCAT of shards and their counts):
    one row, not one per shard, which the drivers would each build in Python (and sqlite3 let go of the GIL
    at, a reader thread retaking it behind a busy event loop waiting up to a switch interval each time)."""
    if shards is None or cells is None:
        return {}
    return dict(zip(map(int, shards.split(",")), map(int, cells.split(",")), strict=True))


def uuid_from_bytes(raw: bytes) -> uuid.UUID:
    """``uuid.UUID(bytes=raw)`` without its argument checks (raw is a stored 16-byte key), which cost more than
    the rest of building it."""
    value = _new_object(uuid.UUID)
    _set(value, "int", int.from_bytes(raw, "big"))
    _set(value, "is_safe", _UNKNOWN)
    return value


def make_cell(
    shard: int,
    added_id: int,
    row_key: bytes,
    column: str,
    ref_key: int,
    blob: bytes,
    created_at: dt.datetime,
    max_bytes: int,
) -> Cell:
    """A stored row as a cell, its body inflated within ``max_bytes`` (:func:`logstore.cell.decode_body`)."""
    return make_sized_cell(shard, added_id, row_key, column, ref_key, blob, created_at, max_bytes)[0]


def make_sized_cell(
    shard: int,
    added_id: int,
    row_key: bytes,
    column: str,
    ref_key: int,
    blob: bytes,
    created_at: dt.datetime,
    max_bytes: int,
) -> tuple[Cell, int]:
    """:func:`make_cell`, and the size of the body's MessagePack form (what a log page's budget counts)."""
    key = uuid_from_bytes(row_key)
    # Decoded here and in make_sized_packed_cell alike, not through a helper taking the decoder: that was a
    # call more per cell read.
    try:
        packed = inflate_body(blob, max_bytes)
        body = unpack_map(packed)
    except CorruptCellError as exc:
        raise _named(exc, shard, added_id, key, column, ref_key, created_at) from None
    cell: Cell = _new_tuple(Cell, (key, column, ref_key, body, added_id, shard, created_at))
    return cell, len(packed)


def make_sized_packed_cell(
    shard: int,
    added_id: int,
    row_key: bytes,
    column: str,
    ref_key: int,
    blob: bytes,
    created_at: dt.datetime,
    max_bytes: int,
) -> tuple[PackedCell, int]:
    """:func:`make_sized_cell` with the body inflated only (:func:`logstore.cell.unpack_body`)."""
    key = uuid_from_bytes(row_key)
    try:
        packed = unpack_body(blob, max_bytes)
    except CorruptCellError as exc:
        raise _named(exc, shard, added_id, key, column, ref_key, created_at) from None
    cell: PackedCell = _new_tuple(PackedCell, (key, column, ref_key, packed, added_id, shard, created_at))
    return cell, len(packed)


def _named(exc: CorruptCellError, shard: int, added_id: int, key: uuid.UUID, column: str, ref_key: int,
           created_at: dt.datetime) -> CorruptCellError:
    """The decoding error ``exc`` naming the cell."""
    where = {"shard": shard, "added_id": added_id, "row_key": key, "column": column,
             "ref_key": ref_key, "created_at": created_at}
    return CorruptCellError(exc.problem, where)


def repack(cell: Cell) -> PackedCell:
    """A decoded cell as a PackedCell (for backends without the stored bytes at hand)."""
    return PackedCell(cell.row_key, cell.column, cell.ref_key, msgpack.packb(cell.body, use_bin_type=True),
                      cell.added_id, cell.shard, cell.created_at)


class ReadBudget:
    """The bytes of bodies (their MessagePack form) a log read may still bring: :meth:`Store.read_pages
    <logstore.store.Store.read_pages>` makes one per read from the store's ``max_read_bytes``, and every page of
    the read draws on it as it is decoded (:func:`decode_log`)."""

    __slots__ = ("room",)

    def __init__(self, room: int) -> None:
        self.room = room


class TruncatedPage(list[_Item]):
    """A log page cut short by its read's byte budget (:class:`ReadBudget`): the shard holds cells after its last
    one, so its reader reads on from there. Only such a page is cut short: a plain list holding fewer cells than
    the ``limit`` asked for reached the end of the log. A cell's versions (:meth:`NodeRecorder.get_versions`) and a
    batched read (:meth:`NodeRecorder.read_cells`: the cells of its first coordinates) are cut short the same way."""

    __slots__ = ()


def decode_log(rows: Sequence[R], to_cell: Callable[[R, int], tuple[C, int]], max_body: int,
               budget: ReadBudget) -> list[C]:
    """A page of log rows as cells, each body inflated within ``max_body`` bytes (``to_cell`` gives each cell
    with its body's size); a damaged cell raises with the good cells before it. Once the read's ``budget`` is
    spent the page ends with the cell that spent it, a :class:`TruncatedPage` when rows follow: a page holds
    one cell at least, and a read's bodies come to at most its budget plus one body per page."""
    cells: list[C] = []
    room = budget.room
    try:
        for row in rows:
            cell, size = to_cell(row, max_body)
            cells.append(cell)
            room -= size
            if room <= 0 and len(cells) < len(rows):
                return TruncatedPage(cells)
    except CorruptCellError as exc:
        exc.cells_before = cells
        raise
    finally:
        budget.room = room
    return cells


def decode_in_order(rows: Sequence[R | None], to_cell: Callable[[R, int], tuple[Cell, int]], max_body: int,
                    budget: ReadBudget) -> list[Cell | None]:
    """The rows of a batched read (:meth:`NodeRecorder.read_cells`), one per coordinate in its order (None: no
    cell), as cells within ``max_body`` and ``budget``: once the budget is spent the answer ends with the cell
    that spent it, a :class:`TruncatedPage` when coordinates follow."""
    out: list[Cell | None] = []
    room = budget.room
    try:
        for i, row in enumerate(rows):
            if room <= 0 and i:
                return TruncatedPage(out)
            if row is None:
                out.append(None)
                continue
            cell, size = to_cell(row, max_body)
            out.append(cell)
            room -= size
    finally:
        budget.room = room
    return out


def decode_pages(pages: Mapping[int, list[R]], to_cell: Callable[[R, int], tuple[C, int]],
                 order: Callable[[R], Any], max_body: int, budget: ReadBudget) -> dict[int, list[C] | CorruptCellError]:
    """Each shard's page of log rows as cells in ``order`` (by added_id: the queries reading several shards at
    once promise none), within ``max_body`` and ``budget`` (:func:`decode_log`), or the CorruptCellError of its
    first damaged cell (with the good cells before it)."""
    out: dict[int, list[C] | CorruptCellError] = {}
    for shard, rows in pages.items():
        rows.sort(key=order)
        try:
            out[shard] = decode_log(rows, to_cell, max_body, budget)
        except CorruptCellError as exc:
            out[shard] = exc
    return out


class UndecodedPages:
    """Pages of several shards read by :meth:`~logstore.store.Store.read_pages` and not decoded yet:
    :meth:`decode` builds the cells (or a page's CorruptCellError) on the thread that calls it.

    Reading is I/O, for a worker thread; decoding holds the GIL but for each body's zlib call, so a reader
    beside a busy event loop decodes on the loop's thread rather than queue for the GIL after every cell
    (docs/logstore.md, "Reading apart from decoding")."""

    __slots__ = ("_parts",)

    def __init__(self, parts: Sequence[Callable[[], Mapping[int, Sequence[AnyCell] | CorruptCellError]]]) -> None:
        self._parts = parts

    def decode(self) -> dict[int, Sequence[AnyCell] | CorruptCellError]:
        """Every shard's page: its cells, or the CorruptCellError of its first damaged cell."""
        out: dict[int, Sequence[AnyCell] | CorruptCellError] = {}
        for part in self._parts:
            out.update(part())
        return out


def split_existing(
    cells: Sequence[PendingCell], existing: dict[Coordinates, Cell]
) -> list[PendingCell]:
    """The cells still to insert; raise CellConflictError if one exists with another body."""
    missing = []
    for cell in cells:
        stored = existing.get(cell.coordinates)
        if stored is None:
            missing.append(cell)
        elif not same_json(stored.body, cell.body):
            raise CellConflictError(cell.row_key, cell.column, cell.ref_key)
    return missing


def ordered_result(
    cells: Sequence[PendingCell], stored: dict[Coordinates, Cell]
) -> list[Cell]:
    """The stored cell for each input cell, in input order.

    A cell read back from the database carries the body the caller gave (equal by
    ``same_json``), so a put never pays to decode what it just encoded.
    """
    return [stored[c.coordinates]._replace(body=c.body) for c in cells]
