"""What every place that keeps consumer offsets answers: its consumers, their positions and lag, and a reset
planned (a dry run) then carried out."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from logstore import Store
from logstore.positions import Position, resolve_positions


@dataclass(frozen=True)
class PositionRow:
    """One position of a consumer: in a shard (``shard`` set), or in a Kafka partition (``key`` is
    ``topic/partition``, ``shard`` None).

    ``location`` is the committed position (None: never committed), ``end`` the shard's head or the partition's
    end offset, ``lag`` how many cells (messages) are still to be delivered. ``published``, for a tailer whose
    workers report it, is how far Kafka has acknowledged beyond the commit: the lag is counted from it.
    """

    key: str
    shard: int | None
    location: int | None
    end: int
    lag: int
    owner: str | None = None
    published: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"key": self.key, "shard": self.shard, "location": self.location, "end": self.end, "lag": self.lag,
               "owner": self.owner}
        if self.published is not None:
            out["published"] = self.published
        return out


@dataclass
class ConsumerPositions:
    """A consumer's positions in one place. ``holders`` are the processes holding them now, when the place
    can tell (ZooKeeper's live workers, a lock on an offsets file, a Kafka group's members); ``note`` says what
    the place cannot tell."""

    name: str
    place: str
    where: str
    rows: list[PositionRow]
    holders: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def lag(self) -> int:
        return sum(row.lag for row in self.rows)

    @property
    def lagging(self) -> int:
        """How many shards (partitions) have something still to deliver."""
        return sum(1 for row in self.rows if row.lag)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "place": self.place, "where": self.where, "lag": self.lag,
                "lagging": self.lagging, "positions": len(self.rows), "holders": self.holders, "note": self.note}

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "rows": [row.to_json() for row in self.rows]}


@dataclass
class ResetPlan:
    """The positions a reset moves, from where to where, and who holds them now.

    ``coordinated`` is true when the place hands the new positions to the running holders through their
    fencing (the store); otherwise a plan with holders cannot be carried out.
    """

    name: str
    place: str
    where: str
    target: str
    changes: list[tuple[str, int | None, int]]
    holders: list[str] = field(default_factory=list)
    coordinated: bool = False
    reset_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        moved = [c for c in self.changes if c[1] != c[2]]
        return {"name": self.name, "place": self.place, "where": self.where, "to": self.target,
                "positions": len(self.changes), "moved": len(moved), "holders": self.holders,
                "coordinated": self.coordinated, "reset": self.reset_id,
                "changes": [{"key": key, "from": before, "to": after} for key, before, after in self.changes]}


def shard_rows(store: Store, positions: Mapping[int, tuple[int | None, str | None, int | None]],
               columns: Sequence[str] | None = None) -> list[PositionRow]:
    """The rows of shard positions (shard -> committed location, owner, published location), each with its
    shard's head and the cells (of ``columns``, those the consumer reads, when known) after the furthest of the
    two locations: a reader of some columns never passes the others' cells, which are no lag of its own, and a
    reader of every column passes over cellstream's own (``_job``, ``_index``...)."""
    heads = store.heads(positions)
    after = store.counts_after({shard: max(location or 0, published or 0)
                                for shard, (location, _owner, published) in positions.items()}, columns=columns,
                               reserved=columns is not None)
    return [PositionRow(str(shard), shard, location, heads[shard], after[shard], owner, published)
            for shard, (location, owner, published) in sorted(positions.items())]


def up_to(store: Store, rows: list[PositionRow], ends: Mapping[int, int],
          columns: Sequence[str] | None = None) -> list[PositionRow]:
    """``rows`` of a reader that stops at each shard's end in ``ends`` (a backfill's targets, a replay's ends):
    the cells beyond it are no lag of its own, and its end is the lower of that and the shard's head."""
    beyond = store.counts_after(ends, columns=columns, reserved=columns is not None)
    out = []
    for row in rows:
        shard = row.shard
        if shard is not None and shard in ends:
            row = dataclasses.replace(row, end=min(row.end, ends[shard]), lag=max(0, row.lag - beyond[shard]))
        out.append(row)
    return out


class OffsetsPlace(abc.ABC):
    """One place consumers keep offsets in. ``kind`` names it (``store``, ``zookeeper``, ``file``, ``kafka``);
    ``where`` says which one (an address, a path)."""

    kind: ClassVar[str]
    where: str

    @abc.abstractmethod
    def consumers(self) -> list[str]:
        """The names of the consumers with offsets here, sorted.

        Raises:
            CellstreamError: the place cannot be read (retriable when its server is unavailable).
        """

    def holds(self, name: str) -> bool:
        """Whether a consumer of that name keeps offsets here (one :meth:`consumers` leaves out too)."""
        return name in self.consumers()

    @abc.abstractmethod
    def positions(self, name: str) -> ConsumerPositions:
        """The consumer's positions, lag and holders.

        Raises:
            ConsumerNotFoundError: no consumer of that name here.
            CellstreamError: the place cannot be read.
        """

    @abc.abstractmethod
    def plan_reset(self, name: str, position: Position, shards: list[int] | None) -> ResetPlan:
        """What a reset of the consumer to ``position`` (in ``shards``, default all) would change; changes
        nothing.

        Raises:
            ConsumerNotFoundError: no consumer of that name here.
            InvalidArgumentError: the position cannot apply here (e.g. shard locations for a Kafka group).
            CellstreamError: the place cannot be read.
        """

    @abc.abstractmethod
    def execute(self, plan: ResetPlan) -> ResetPlan:
        """Carry a plan out; answer it as done (``reset_id`` set).

        Raises:
            ConsumerRunningError: processes hold the offsets and the place cannot coordinate with them.
            CellstreamError: the place cannot be written.
        """


class ShardOffsetsPlace(OffsetsPlace):
    """A place keeping a position per shard of ``store``: a reset's plan is each chosen shard's resolved
    location. ``coordinated`` says whether :meth:`execute` hands it to running holders (else refuses)."""

    store: Store
    coordinated: ClassVar[bool] = False

    def plan_reset(self, name: str, position: Position, shards: list[int] | None) -> ResetPlan:
        current = self.positions(name)
        targets = resolve_positions(self.store, position, shards)
        before = {row.shard: row.location for row in current.rows}
        changes = [(str(shard), before.get(shard), location) for shard, location in targets.items()]
        return ResetPlan(name, self.kind, self.where, str(position), changes, current.holders, self.coordinated)
