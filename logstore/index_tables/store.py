"""The store's index tables across its nodes: ``store.indexes`` (see :mod:`logstore.index_tables.persistence`).

>>> spec = IndexSpec(name="by_driver", version=1, shard_field="driver", fields=[...])  # doctest: +SKIP
>>> store.indexes.create(spec)                                                     # doctest: +SKIP
>>> store.indexes.apply(spec, [IndexChange(shard, added_id, row_key, ref_key, values)])  # doctest: +SKIP
>>> store.indexes.query(spec, [Condition("driver", "=", driver)])                  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from logstore.errors import InvalidArgumentError, ShardMovedError
from logstore.index_tables.persistence import (
    NO_ENTRY,
    ApplyResult,
    Condition,
    EntryWrite,
    Fix,
    IndexChange,
    IndexEntry,
    IndexPosition,
    IndexRecorder,
    IndexSpec,
    Locator,
    Order,
    StrayRows,
    Stream,
    check_conditions,
    encode_row,
    new_positions,
    shard_of_value,
)

MAX_QUERY_LIMIT = 100_000
_MOVE_HOPS = 40  # an index write meeting a moved shard reloads the map and tries again, this many times at most
logger = logging.getLogger(__name__)


class ShardRouter(Protocol):
    """What the index tables need of a store: its shards, and the index recorder of each."""

    shard_count: int

    @property
    def recorders(self) -> Sequence[IndexRecorder]:
        """One per node, as the shard map has the nodes now."""

    def check_shard(self, shard: object) -> int:
        """``shard`` when it is a shard of the store; InvalidArgumentError otherwise."""

    def shard_of(self, row_key: uuid.UUID | str) -> int:
        """The shard of a row."""

    def recorder_of(self, shard: int) -> IndexRecorder:
        """The index recorder of the node holding ``shard`` now."""

    def holdings(self) -> Sequence[tuple[IndexRecorder, Sequence[int] | None]]:
        """Each node's index recorder and the shards the map gives it now (None: every row the node holds
        is its own, in a store whose shards never move)."""

    def refresh_map(self) -> None:
        """Read the shard map again now: a node refused an index write of a shard that moved away."""


class IndexStore:
    """Index tables on every node of a store: creation, apply, queries, positions."""

    def __init__(self, router: ShardRouter) -> None:
        self._store = router
        self._recorder_of = router.recorder_of

    def _all(self) -> Sequence[IndexRecorder]:
        return self._store.recorders

    def _by_node(self, shards: Iterable[int]) -> dict[int, tuple[IndexRecorder, list[int]]]:
        out: dict[int, tuple[IndexRecorder, list[int]]] = {}
        for shard in shards:
            recorder = self._recorder_of(shard)
            out.setdefault(id(recorder), (recorder, []))[1].append(shard)
        return out

    def _each_node(self, shards: Iterable[int], run: Callable[[IndexRecorder, list[int]], None]) -> None:
        """``run(recorder, its shards)`` for each node holding some of ``shards``. A node that refuses a shard
        moved away (ShardMovedError: its transaction wrote nothing) has its shards sent again where the map,
        read again, says they are: while a move's switch is under way, a few times, waiting a little longer
        each time (as the store's writes do)."""
        todo = sorted(shards)
        for attempt in range(_MOVE_HOPS):
            moved: list[int] = []
            for recorder, group in self._by_node(todo).values():
                try:
                    run(recorder, group)
                except ShardMovedError as exc:
                    if attempt == _MOVE_HOPS - 1:
                        raise
                    logger.info("%s: reloading the shard map", exc)
                    moved.extend(group)
            if not moved:
                return
            if attempt:
                time.sleep(0.05 * attempt)
            self._store.refresh_map()
            todo = sorted(moved)

    def entry_shard(self, spec: IndexSpec, value: Any) -> int:
        """The shard an entry with this shard-field value lives in."""
        kind = spec.field(spec.shard_field).type
        return shard_of_value(kind, value, self._store.shard_count)

    # -- tables ---------------------------------------------------------------------
    def create(self, spec: IndexSpec) -> None:
        """Create the version's tables on every node (idempotent); ConfigurationError if a node holds
        the same version with another definition."""
        for recorder in self._all():
            recorder.create(spec)

    def drop(self, spec: IndexSpec) -> None:
        for recorder in self._all():
            recorder.drop(spec)

    def specs(self) -> list[IndexSpec]:
        """The index versions the nodes hold (by table)."""
        found: dict[str, IndexSpec] = {}
        for recorder in self._all():
            for spec in recorder.specs():
                found.setdefault(spec.table, spec)
        return [found[t] for t in sorted(found)]

    # -- writes ---------------------------------------------------------------------
    def apply(self, spec: IndexSpec, changes: Sequence[IndexChange], stream: Stream | None = "live",
              through: Mapping[int, int] | None = None) -> ApplyResult:
        """Apply changes (in each source shard's log order); one transaction per node of their source
        shards, which also records the stream's position in each shard: the last change's added_id, or
        ``through[shard]`` when higher (the end of a page whose last cells were not for the index).
        Changes at or below the stream's position are skipped (applied before). With ``stream`` None
        no position is read or written (a replay of one cell). A change with ``values`` None removes its row's
        entry (a tombstone). Every change is checked before anything is written: a bad one raises
        InvalidArgumentError and nothing changes."""
        if stream not in ("live", "backfill", None):
            raise InvalidArgumentError(f"stream must be 'live', 'backfill' or None, got {stream!r}")
        positions = new_positions(changes)
        for shard, location in (through or {}).items():
            self._store.check_shard(shard)
            positions[shard] = max(location, positions.get(shard, 0))
        kind = spec.field(spec.shard_field).type
        shards = self._store.shard_count
        targets: dict[int, tuple[int, list[Any]]] = {}  # by id(change): the changes live through the call
        for index, change in enumerate(changes):
            if not isinstance(change, IndexChange):
                raise InvalidArgumentError(f"change #{index} is a {type(change).__name__}, not an IndexChange")
            self._store.check_shard(change.shard)
            if type(change.added_id) is not int or change.added_id < 1 or type(change.ref_key) is not int:
                raise InvalidArgumentError(f"change #{index}: added_id and ref_key must be integers")
            if change.values is None:  # a removal: plan() asks no entry of it
                continue
            targets[id(change)] = (
                shard_of_value(kind, change.values[spec.shard_field], shards), encode_row(spec, change.values))
        total = ApplyResult()

        def run(recorder: IndexRecorder, group: list[int]) -> None:
            nonlocal total
            wanted = set(group)
            mine = [c for c in changes if c.shard in wanted]
            total += recorder.apply(spec, stream, mine, {s: positions[s] for s in group},
                                    lambda c: targets[id(c)], self._remote(spec, recorder))
        self._each_node(positions, run)
        return total

    def repair(self, spec: IndexSpec, fixes: Sequence[Fix], keep: Callable[[uuid.UUID, Locator], bool]) -> int:
        """Verification's repairs: each row's entry and locator made those of its fix, in one transaction per
        node of the rows' shards holding their locators' locks (other nodes' writes commit first, like an
        apply's). ``keep(row_key, locator)`` is asked, under the lock, about a row whose locator is past
        its fix: True leaves it alone (a newer cell was applied since). Returns the rows fixed."""
        for index, fix in enumerate(fixes):
            if not isinstance(fix, Fix):
                raise InvalidArgumentError(f"fix #{index} is a {type(fix).__name__}, not a Fix")
            if fix.shard != self._store.shard_of(fix.row_key):
                raise InvalidArgumentError(f"fix #{index}: row {fix.row_key} is in shard "
                                           f"{self._store.shard_of(fix.row_key)}, not {fix.shard}")
            if fix.values is None:
                if fix.entry_shard != NO_ENTRY:
                    raise InvalidArgumentError(f"fix #{index}: row {fix.row_key} has no entry, so its entry shard "
                                               f"must be {NO_ENTRY}, not {fix.entry_shard}")
            else:
                encode_row(spec, fix.values)
                if fix.entry_shard != self.entry_shard(spec, fix.values[spec.shard_field]):
                    raise InvalidArgumentError(f"fix #{index}: the entry of row {fix.row_key} belongs in shard "
                                               f"{self.entry_shard(spec, fix.values[spec.shard_field])}")
            for shard in fix.clear:
                self._store.check_shard(shard)
        fixed = 0

        def run(recorder: IndexRecorder, group: list[int]) -> None:
            nonlocal fixed
            wanted = set(group)
            fixed += recorder.repair(spec, [f for f in fixes if f.shard in wanted], keep,
                                     self._remote(spec, recorder))
        self._each_node({f.shard for f in fixes}, run)
        return fixed

    def _remote(self, spec: IndexSpec, recorder: IndexRecorder) -> Callable[[list[EntryWrite]], list[EntryWrite]]:
        """What an apply on ``recorder``'s node does with its entry writes: those of other nodes are written
        there (each node one transaction), the node's own are handed back."""
        def remote(writes: list[EntryWrite]) -> list[EntryWrite]:
            local: list[EntryWrite] = []
            for other, shards_of_other in self._by_node(sorted({w.shard for w in writes})).values():
                held = set(shards_of_other)
                theirs = [w for w in writes if w.shard in held]
                if other is recorder:
                    local = theirs
                else:
                    other.write_entries(spec, theirs)
            return local
        return remote

    def set_targets(self, spec: IndexSpec, stream: Stream, targets: Mapping[int, int]) -> None:
        self._each_node(targets, lambda recorder, group: recorder.set_targets(spec, stream,
                                                                              {s: targets[s] for s in group}))

    # -- reads ------------------------------------------------------------------------
    def query(self, spec: IndexSpec, conditions: Sequence[Condition], *, order: Order = "asc",
              limit: int = 1000, scatter: bool = False) -> list[IndexEntry]:
        """Entries matching every condition, ordered by the query keys after the shard field (in declaration
        order, like a clustering key) then row_key. With an equality on
        the shard field this reads one shard; without one it reads every node, concurrently, and only
        when ``scatter`` is True (InvalidArgumentError otherwise)."""
        if order not in ("asc", "desc"):
            raise InvalidArgumentError(f"order must be 'asc' or 'desc', got {order!r}")
        if type(limit) is not int or not 1 <= limit <= MAX_QUERY_LIMIT:
            raise InvalidArgumentError(f"limit must be an integer in [1, {MAX_QUERY_LIMIT}], got {limit!r}")
        given = [c if type(c) is Condition else Condition(*c) for c in conditions]
        stored = check_conditions(spec, given)
        for c in given:
            if c.field == spec.shard_field and c.op == "=":
                shard = self.entry_shard(spec, c.value)
                return self._recorder_of(shard).query(spec, [shard], stored, order, limit)
        if not scatter:
            raise InvalidArgumentError(
                f"index {spec.name}: a query without {spec.shard_field} reads every shard; ask for it with scatter")
        # Each node answers for the shards the map gives it, and for no other: a moved shard's source copy
        # (until dropped) and a move's copy on its target (until the switch) are never counted twice.
        count = self._store.shard_count
        nodes = [(r, None if held is None or len(held) == count else held)
                 for r, held in self._store.holdings() if held is None or held]
        if len(nodes) == 1:
            return nodes[0][0].query(spec, nodes[0][1], stored, order, limit)
        with concurrent.futures.ThreadPoolExecutor(len(nodes), thread_name_prefix="scatter") as pool:
            parts = list(pool.map(lambda node: node[0].query(spec, node[1], stored, order, limit), nodes))

        def sort_key(entry: IndexEntry) -> tuple[Any, ...]:
            return (*(entry.fields[k] for k in spec.keys[1:]), entry.row_key)
        merged = heapq.merge(*parts, key=sort_key, reverse=order == "desc")
        return [entry for entry, _ in zip(merged, range(limit), strict=False)]

    def positions(self, spec: IndexSpec, stream: Stream = "live") -> dict[int, IndexPosition]:
        """The stream's position in every source shard that has one (on the node holding the shard)."""
        out: dict[int, IndexPosition] = {}
        for recorder, held in self._store.holdings():
            found = recorder.positions(spec, stream)
            if held is not None:
                mine = set(held)
                found = {s: p for s, p in found.items() if s in mine}
            out.update(found)
        return out

    def strays(self, spec: IndexSpec) -> list[StrayRows]:
        """The version's rows that nodes keep in shards the map gives other nodes (see StrayRows)."""
        return [stray for recorder, held in self._store.holdings() if held is not None
                for stray in recorder.strays(spec, held)]

    def drop_strays(self, spec: IndexSpec, strays: Sequence[StrayRows]) -> int:
        """Delete the ``moved`` ones of ``strays`` (source copies of shards moved away) that are still stray
        (the map, read again, gives the shard another node); returns the rows deleted."""
        self._store.refresh_map()
        holdings = {recorder.name: (recorder, held) for recorder, held in self._store.holdings()}
        dropped = 0
        for stray in strays:
            recorder, held = holdings.get(stray.node, (None, None))
            if recorder is not None and held is not None and stray.moved and stray.shard not in held:
                dropped += recorder.drop_shard(spec, stray.shard)
        return dropped

    def scan(self, spec: IndexSpec, shard: int, after: uuid.UUID | None = None, limit: int = 1000) -> list[IndexEntry]:
        """The entries stored in ``shard``, in row_key order after ``after``."""
        self._store.check_shard(shard)
        return self._recorder_of(shard).scan(spec, shard, after, limit)

    def locators(self, spec: IndexSpec, row_keys: Sequence[uuid.UUID]) -> dict[uuid.UUID, Locator]:
        """Where the entries of these rows live and which ref_key they reflect (rows never applied: absent)."""
        out: dict[uuid.UUID, Locator] = {}
        by_shard: dict[int, list[uuid.UUID]] = {}
        for key in row_keys:
            by_shard.setdefault(self._store.shard_of(key), []).append(key)
        for recorder, shards in self._by_node(sorted(by_shard)).values():
            out.update(recorder.locators(spec, [k for s in shards for k in by_shard[s]]))
        return out
