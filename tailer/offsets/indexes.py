"""The positions of the secondary indexes' appliers: how far each index version's live stream (and a
backfill under way) has applied every shard's log, kept in the index tables beside the entries. They are
shown with their lag; they are never reset here: an index's entries and its position move together, and an
index is rebuilt with ``cellstream index backfill``."""

from __future__ import annotations

from logstore import Store
from logstore.errors import ConfigurationError, IndexUnknownError, InvalidArgumentError
from logstore.index_tables.persistence import IndexSpec
from logstore.index_tables.query import index_info
from logstore.positions import Position
from tailer.errors import ConsumerNotFoundError
from tailer.offsets.places import ConsumerPositions, OffsetsPlace, ResetPlan, shard_rows, up_to

PREFIX = "index."


def consumer_name(spec: IndexSpec, stream: str) -> str:
    """``index.NAME.vVERSION`` (live) or ``index.NAME.vVERSION.backfill``."""
    return f"{PREFIX}{spec.name}.v{spec.version}" + ("" if stream == "live" else f".{stream}")


class IndexOffsets(OffsetsPlace):
    """The index appliers of the store's indexes (read only)."""

    kind = "index"

    def __init__(self, store: Store) -> None:
        self.store = store
        self.where = "index tables"

    def _streams(self) -> dict[str, tuple[IndexSpec, str]]:
        """The live stream of every version, and its backfill while one is under way (a shard short of its
        target)."""
        out: dict[str, tuple[IndexSpec, str]] = {}
        try:
            specs = self.store.indexes.specs()
        except ConfigurationError:  # a worker node's client: the CLI leaves this place out, saying so
            return out
        for spec in specs:
            out[consumer_name(spec, "live")] = (spec, "live")
            backfill = self.store.indexes.positions(spec, "backfill")
            if any(p.target is None or p.location < p.target for p in backfill.values()):
                out[consumer_name(spec, "backfill")] = (spec, "backfill")
        return out

    def consumers(self) -> list[str]:
        return sorted(self._streams())

    def positions(self, name: str) -> ConsumerPositions:
        found = self._streams().get(name)
        if found is None:
            raise ConsumerNotFoundError(f"no index applier named {name!r} (they are index.NAME.vVERSION)")
        spec, stream = found
        positions = self.store.indexes.positions(spec, stream)  # type: ignore[arg-type]
        try:  # the version's source column: its cells are the applier's, and no other's
            columns: list[str] | None = [index_info(self.store, spec.name).version(spec.version).column]
        except IndexUnknownError:
            columns = None  # tables without a catalog record: every column's cells counted
        rows = shard_rows(self.store, {shard: (at.location if (at := positions.get(shard)) else None, None, None)
                                       for shard in range(self.store.shard_count)}, columns)
        if stream == "backfill":  # a backfill ends at each shard's head when it started, not at today's
            rows = up_to(self.store, rows, {p.shard: p.target for p in positions.values() if p.target is not None},
                         columns)
        return ConsumerPositions(name, self.kind, self.where, rows, [],
                                 "applied by the apps that keep the index; never reset: rebuild with index backfill")

    def plan_reset(self, name: str, position: Position, shards: list[int] | None) -> ResetPlan:
        raise InvalidArgumentError(f"{name}: an index's position moves with its entries; rebuild the index with "
                                   "`cellstream index backfill` instead of resetting it")

    def execute(self, plan: ResetPlan) -> ResetPlan:
        return self.plan_reset(plan.name, Position("end"), None)
