"""Verification: compare an index version with the cells it comes from, and repair what differs.

FriendFeed's "cleaner" for its denormalized indexes, with a brute-force reference:
a row's entry must be the one of its highest-ref_key cell of the column that fits the
definition (or is a tombstone), in the shard of that cell's shard field, and nowhere
else; its locator must name that cell and shard; a row whose highest such cell is a
tombstone has no entry, and its locator names the tombstone with entry shard
NO_ENTRY; a row without such a cell has no entry and no locator. ``--sample RATE``
checks that fraction of the rows (picked by a salted hash of the row key, so both
sides of the comparison pick the same rows).

It runs beside live processing without false alarms by reading in this order:
1. the positions: how far live processing and the backfill applied each shard (only
   a backfilled version is verified: before, nothing says which cells were applied);
2. every entry, scanning each entry shard;
3. every shard's log of the column, up to its head; then the locators of the rows.
A row with a fitting cell past its shard's position is *pending* (being applied, or
lagging) and is left for the next run. Any other row was settled before step 1, so
its entries and locator cannot change during the run, and every cell an entry of
step 2 reflects was committed before step 3 read the log. A locator past every cell
step 3 saw is looked up: a real newer cell makes the row pending too.

Repairs (``repair=True``) go through :meth:`logstore.index_tables.store.IndexStore.repair`,
which locks each row's locator and leaves alone a row a newer cell reached meanwhile.

Last, it lists the *stray* rows nodes keep in shards the map gives other nodes (queries never read
them): a moved shard's source copy, which a repair deletes, or a move's copy before its switch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from indexer.errors import EntryFieldError, IndexStateError, InvalidQueryError
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.definitions import IndexDefinition
from logstore import Store
from logstore.cell import is_tombstone
from logstore.index_tables.persistence import NO_ENTRY, Fix, IndexEntry, Locator, StrayRows, encode_row

logger = logging.getLogger(__name__)
Kind = Literal["missing", "stale", "different", "misplaced", "orphan", "locator"]
_SETTLED_STATES = frozenset({"ready", "active", "retired"})  # backfilled: live and backfill together cover the log
_FIX_BATCH = 500


class Mismatch(NamedTuple):
    """One difference between the index and the cells, for one row."""

    kind: Kind
    row_key: uuid.UUID
    shard: int | None  # the entry's shard (the locator's entry shard for kind "locator")
    ref_key: int | None  # the ref_key the index holds
    expected_ref_key: int | None  # of the cell the entry must reflect (None: no entry)
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {**self._asdict(), "row_key": str(self.row_key)}


class VerifyProgress(NamedTuple):
    """How far a verification is: in ``phase`` "entries", the entries of ``shards_done`` of the store's
    ``shards`` shards scanned; then, in phase "log", the logs of ``shards_done`` shards read."""

    phase: Literal["entries", "log"]
    shards_done: int
    shards: int
    rows: int  # sampled rows seen so far (in the phase's reading)


class VerifyResult(NamedTuple):
    name: str
    version: int
    sample: float
    rows: int  # sampled rows checked (settled)
    pending: int  # sampled rows with cells not applied yet: not checked
    entries: int  # entries read
    cells: int  # cells of the column read
    mismatches: list[Mismatch]
    repaired: int
    changed: int  # rows to repair that a newer cell reached meanwhile: left alone
    seconds: float
    # Rows nodes keep in shards the map gives other nodes (a moved shard's source copy, a move's copy
    # before its switch): never read by queries, found apart from the rows' checks.
    strays: tuple[StrayRows, ...] = ()
    strays_dropped: int = 0  # rows of moved shards' source copies deleted (with ``repair``)

    @property
    def strays_left(self) -> int:
        """Stray rows still there: a move's copy before its switch is never deleted here."""
        return sum(s.rows for s in self.strays) - self.strays_dropped

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.mismatches:
            out[m.kind] = out.get(m.kind, 0) + 1
        return out


class _Row:
    """What the log holds for one row: its best fitting cell up to the position, and whether one is past it.
    A tombstone counts as fitting, with no values: ``ref_key`` >= 0 and ``values`` None is a removed row."""

    __slots__ = ("fitting", "pending", "ref_key", "values")

    def __init__(self) -> None:
        self.ref_key = -1
        self.values: dict[str, Any] | None = None
        self.pending = False
        self.fitting: set[int] = set()  # every fitting (or tombstone) ref_key seen


class _Check:
    def __init__(self, store: Store, definition: IndexDefinition, sample: float) -> None:
        self.store, self.definition, self.spec = store, definition, definition.spec
        self.sample = sample
        self._salt = os.urandom(16)
        self._threshold = int(sample * (1 << 64))

    def sampled(self, row_key: uuid.UUID) -> bool:
        if self.sample >= 1:
            return True
        digest = hashlib.blake2b(row_key.bytes, digest_size=8, key=self._salt).digest()
        return int.from_bytes(digest, "big") < self._threshold

    def fits(self, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self.definition.entry(body)
        except EntryFieldError:
            return None

    def newer_cell(self, row_key: uuid.UUID, locator: Locator) -> bool:
        """Whether a locator names a real fitting cell of the row whose entry goes where it says (a tombstone,
        for a locator of no entry)."""
        cell = self.store.get_cell(row_key, self.definition.column, locator.ref_key)
        if cell is not None and is_tombstone(cell.body):
            return locator.entry_shard == NO_ENTRY
        values = self.fits(cell.body) if cell is not None else None
        return values is not None and self.entry_shard(values) == locator.entry_shard

    def entry_shard(self, values: dict[str, Any]) -> int:
        return self.store.indexes.entry_shard(self.spec, values[self.spec.shard_field])

    def compare(self, row_key: uuid.UUID, row: _Row | None, copies: list[IndexEntry],
                locator: Locator | None) -> list[Mismatch]:
        """The mismatches of a settled row."""
        out: list[Mismatch] = []
        want = row.values if row is not None else None
        if row is not None and want is None and row.ref_key >= 0:  # the latest cell is a tombstone
            out.extend(Mismatch("orphan", row_key, e.shard, e.ref_key, None,
                                f"entry of a row whose latest cell (ref_key {row.ref_key}) is a tombstone")
                       for e in copies)
            if locator != Locator(row.ref_key, NO_ENTRY):
                out.append(Mismatch("locator", row_key, locator.entry_shard if locator else None,
                                    locator.ref_key if locator else None, row.ref_key,
                                    f"locator {tuple(locator) if locator else None}, expected "
                                    f"{(row.ref_key, NO_ENTRY)} (a tombstone: no entry)"))
            return out
        if want is None or row is None:
            out.extend(Mismatch("orphan", row_key, e.shard, e.ref_key, None,
                                "entry of a row with no cell that fits the definition") for e in copies)
            if locator is not None:
                out.append(Mismatch("locator", row_key, locator.entry_shard, locator.ref_key, None,
                                    "locator of a row with no cell that fits the definition"))
            return out
        target = self.entry_shard(want)
        here = [e for e in copies if e.shard == target]
        if not here:
            out.append(Mismatch("missing", row_key, target, None, row.ref_key, f"no entry in shard {target}"))
        for entry in here:
            if entry.ref_key < row.ref_key:
                out.append(Mismatch("stale", row_key, target, entry.ref_key, row.ref_key,
                                    f"entry reflects ref_key {entry.ref_key}, the row's latest is {row.ref_key}"))
            elif entry.ref_key > row.ref_key:
                out.append(Mismatch("different", row_key, target, entry.ref_key, row.ref_key,
                                    f"entry claims ref_key {entry.ref_key}, which no fitting cell has"))
            elif differ := self.differing(entry.fields, want):
                out.append(Mismatch("different", row_key, target, entry.ref_key, row.ref_key,
                                    f"fields differ from the cell's: {', '.join(differ)}"))
        out.extend(Mismatch("misplaced", row_key, e.shard, e.ref_key, row.ref_key,
                            f"copy in shard {e.shard}; the entry belongs in shard {target}")
                   for e in copies if e.shard != target)
        if locator != Locator(row.ref_key, target):
            out.append(Mismatch("locator", row_key, locator.entry_shard if locator else None,
                                locator.ref_key if locator else None, row.ref_key,
                                f"locator {tuple(locator) if locator else None}, expected {(row.ref_key, target)}"))
        return out

    def differing(self, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
        """The fields whose stored forms differ (json by value: its text may order keys differently)."""
        stored, wanted = encode_row(self.spec, got), encode_row(self.spec, want)
        return [f.name for f, a, b in zip(self.spec.fields, stored, wanted, strict=True)
                if (got[f.name] != want[f.name] if f.type == "json" else a != b)]

    def fix(self, row_key: uuid.UUID, row: _Row | None, copies: list[IndexEntry]) -> Fix:
        shard = self.store.shard_of(row_key)
        if row is None or row.values is None:  # no entry; a tombstone's ref_key (>= 0) keeps its locator
            return Fix(shard, row_key, row.ref_key if row is not None else -1, NO_ENTRY, None,
                       tuple(sorted({e.shard for e in copies})))
        target = self.entry_shard(row.values)
        return Fix(shard, row_key, row.ref_key, target, row.values,
                   tuple(sorted({e.shard for e in copies if e.shard != target})))


def verify(store: Store, name: str, version: int | None = None, *, sample: float = 1.0, repair: bool = False,
           page: int = 1000, progress: Callable[[VerifyProgress], None] | None = None) -> VerifyResult:
    """Compare index ``name`` (its active version, or ``version``) with the cells; with ``repair``, fix
    every mismatch found. Reads the whole log of the column and every entry; checks ``sample`` of the rows."""
    if not isinstance(sample, int | float) or not 0 < sample <= 1:
        raise InvalidQueryError(f"sample must be a rate in (0, 1], got {sample!r}")
    started = time.monotonic()
    record = IndexCatalog(store).get(name)
    number = version if version is not None else record.active
    if number is None:
        raise IndexStateError(f"index {name} has no active version; name the version to verify")
    found = record.version(number)
    if found.state not in _SETTLED_STATES:
        raise IndexStateError(f"index {name} version {number} is {found.state}; verify a version once its "
                              "backfill finished")
    definition = found.definition
    check = _Check(store, definition, sample)
    spec, shards = definition.spec, store.shard_count
    # 1. positions
    live = store.indexes.positions(spec, "live")
    backfill = store.indexes.positions(spec, "backfill")
    covered = {s: max(live[s].location if s in live else 0, backfill[s].location if s in backfill else 0)
               for s in range(shards)}

    def report(phase: Literal["entries", "log"], done: int, rows: int) -> None:
        if progress is not None:
            progress(VerifyProgress(phase, done, shards, rows))
    # 2. entries
    copies: dict[uuid.UUID, list[IndexEntry]] = {}
    entries = 0
    for shard in range(shards):
        after = None
        while batch := store.indexes.scan(spec, shard, after, page):
            entries += len(batch)
            for entry in batch:
                if check.sampled(entry.row_key):
                    copies.setdefault(entry.row_key, []).append(entry)
            after = batch[-1].row_key
        report("entries", shard + 1, len(copies))
    # 3. the log, then the locators
    rows: dict[uuid.UUID, _Row] = {}
    cells = 0
    for shard in range(shards):
        location = 0
        while True:
            batch_cells, location = store.get_cells_for_shard(shard, location, page, columns=[definition.column])
            if not batch_cells:
                break
            cells += len(batch_cells)
            for cell in batch_cells:
                if not check.sampled(cell.row_key):
                    continue
                tombstone = is_tombstone(cell.body)
                values = None if tombstone else check.fits(cell.body)
                if values is None and not tombstone:
                    continue
                seen = rows.setdefault(cell.row_key, _Row())
                seen.fitting.add(cell.ref_key)
                if cell.added_id > covered[shard]:
                    seen.pending = True
                elif cell.ref_key > seen.ref_key:
                    seen.ref_key, seen.values = cell.ref_key, values
        report("log", shard + 1, len(rows))
    keys = list(dict.fromkeys([*copies, *rows]))
    locators = store.indexes.locators(spec, keys)
    mismatches: list[Mismatch] = []
    fixes: list[Fix] = []
    pending = 0
    for key in keys:
        row, locator = rows.get(key), locators.get(key)
        known = row.fitting if row is not None else set()
        if (row is not None and row.pending) or (
                locator is not None and locator.ref_key not in known and check.newer_cell(key, locator)):
            pending += 1
            continue
        found_here = check.compare(key, row, copies.get(key, []), locator)
        if found_here:
            mismatches.extend(found_here)
            fixes.append(check.fix(key, row, copies.get(key, [])))
    repaired = 0
    if repair and fixes:
        for start in range(0, len(fixes), _FIX_BATCH):
            repaired += store.indexes.repair(spec, fixes[start:start + _FIX_BATCH], check.newer_cell)
        logger.info("index %s version %d: repaired %d of %d rows", name, number, repaired, len(fixes))
    if mismatches:
        logger.warning("index %s version %d: %d mismatches in %d rows", name, number, len(mismatches), len(fixes))
    # 4. rows outside their shards' nodes: a moved shard's source copy goes with repair, as drop-moved's would.
    strays = store.indexes.strays(spec)
    dropped = store.indexes.drop_strays(spec, strays) if repair and strays else 0
    if strays:
        logger.warning("index %s version %d: %d stray rows in %d shards on nodes that do not hold them%s", name,
                       number, sum(s.rows for s in strays), len(strays), f"; {dropped} deleted" if repair else "")
    return VerifyResult(name, number, sample, len(keys) - pending, pending, entries, cells, mismatches, repaired,
                        len(fixes) - repaired if repair else 0, time.monotonic() - started, tuple(strays), dropped)
