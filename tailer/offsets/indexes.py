"""The positions of the secondary indexes' appliers: how far each index version's live stream (and a
backfill under way) has applied every shard's log, kept in the index tables beside the entries. They are
shown with their lag; they are never reset here: an index's entries and its position move together, and an
index is rebuilt with ``cellstream index backfill``."""

from __future__ import annotations

from logstore import Store
from logstore.errors import ConfigurationError, InvalidArgumentError
from logstore.index_tables.persistence import IndexSpec
from logstore.positions import Position
from tailer.errors import ConsumerNotFoundError
from tailer.offsets.places import ConsumerPositions, OffsetsPlace, ResetPlan, shard_rows

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
        out: dict[str, tuple[IndexSpec, str]] = {}
        try:
            specs = self.store.indexes.specs()
        except ConfigurationError:  # a worker node's client: the index tables are the node's own business
            return out
        for spec in specs:
            for stream in ("live", "backfill"):
                if stream == "live" or self.store.indexes.positions(spec, "backfill"):
                    out[consumer_name(spec, stream)] = (spec, stream)
        return out

    def consumers(self) -> list[str]:
        return sorted(self._streams())

    def positions(self, name: str) -> ConsumerPositions:
        found = self._streams().get(name)
        if found is None:
            raise ConsumerNotFoundError(f"no index applier named {name!r} (they are index.NAME.vVERSION)")
        spec, stream = found
        positions = self.store.indexes.positions(spec, stream)  # type: ignore[arg-type]
        rows = shard_rows(self.store, {shard: (at.location if (at := positions.get(shard)) else None, None, None)
                                       for shard in range(self.store.shard_count)})
        return ConsumerPositions(name, self.kind, self.where, rows, [],
                                 "applied by the apps that keep the index; never reset: rebuild with index backfill")

    def plan_reset(self, name: str, position: Position, shards: list[int] | None) -> ResetPlan:
        raise InvalidArgumentError(f"{name}: an index's position moves with its entries; rebuild the index with "
                                   "`cellstream index backfill` instead of resetting it")

    def execute(self, plan: ResetPlan) -> ResetPlan:
        return self.plan_reset(plan.name, Position("end"), None)
