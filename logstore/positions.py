"""Positions in the shard logs as an operator writes them: where a reset, a replay or a re-publish starts or ends.

A *location* is the last added_id a reader has passed in a shard: reading goes on with the cells after it
(``added_id > location``), and 0 is the beginning. The text forms, shared by ``cellstream offsets reset
--to``, ``cellstream replay --from/--until`` and ``cellstream tail republish``:

- ``beginning``: every shard at 0;
- ``end`` (or ``now``): every shard at its head when resolved (nothing before it is read again);
- an ISO-8601 time with a zone (``2026-11-24T09:00:00Z``): in each shard the location from which reading
  yields every cell created at or after it (:meth:`logstore.Store.location_at`);
- ``SHARD:LOCATION[,SHARD:LOCATION...]``: those shards at those locations exactly, as ``cellstream offsets
  show`` prints them, so what it shows can be given back.

Shard sets are written ``0-99,200,300-310``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from logstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from logstore.store import Store

PositionKind = Literal["beginning", "end", "time", "locations"]


@dataclass(frozen=True)
class Position:
    """A parsed position: ``kind`` says which of the text forms; ``when`` is set for a time, ``locations`` for
    explicit ``SHARD:LOCATION`` pairs."""

    kind: PositionKind
    when: dt.datetime | None = None
    locations: Mapping[int, int] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.kind == "time":
            assert self.when is not None
            return self.when.isoformat()
        if self.kind == "locations":
            return ",".join(f"{shard}:{location}" for shard, location in sorted(self.locations.items()))
        return self.kind


def parse_shards(text: str, shard_count: int) -> list[int]:
    """The shards of a set written ``0-99,200,300-310``, sorted and without repeats.

    Raises:
        InvalidArgumentError: a part is not a shard or a range of shards, or a shard is not below ``shard_count``.
    """
    shards: set[int] = set()
    for part in str(text).split(","):
        item = part.strip()
        first, dash, last = item.partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise InvalidArgumentError(f"shards: {item!r} is neither a shard nor a range FIRST-LAST") from None
        if low < 0 or high < low:
            raise InvalidArgumentError(f"shards: {item!r} is not a range of shards (FIRST-LAST, FIRST <= LAST)")
        if high >= shard_count:
            raise InvalidArgumentError(f"shards: {high} is out of range (the store has shards 0-{shard_count - 1})")
        shards.update(range(low, high + 1))
    return sorted(shards)


def parse_position(text: str) -> Position:
    """A position in one of the text forms (see the module).

    Raises:
        InvalidArgumentError: the text is none of them (a time without a zone included).
    """
    value = str(text).strip()
    if value in ("beginning", "earliest"):
        return Position("beginning")
    if value in ("end", "latest", "now"):
        return Position("end")
    if ":" in value and all(_is_pair(part) for part in value.split(",")):
        locations: dict[int, int] = {}
        for part in value.split(","):
            shard, _, location = part.strip().partition(":")
            if int(shard) in locations:
                raise InvalidArgumentError(f"position: shard {int(shard)} is given twice in {value!r}")
            locations[int(shard)] = int(location)
        return Position("locations", locations=locations)
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise InvalidArgumentError(f"position: {value!r} is not beginning, end, an ISO-8601 time or "
                                   "SHARD:LOCATION[,SHARD:LOCATION...]") from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise InvalidArgumentError(f"position: the time {value!r} has no zone (add Z or +HH:MM)")
    return Position("time", when=when)


def _is_pair(part: str) -> bool:
    shard, colon, location = part.strip().partition(":")
    return bool(colon) and shard.isdigit() and location.isdigit()


def resolve_positions(store: Store, position: Position, shards: Iterable[int] | None = None) -> dict[int, int]:
    """Each shard's location for ``position``: the location after which reading starts.

    Args:
        store: the store whose shards are meant (the heads and times are read from it now).
        position: a parsed position.
        shards: the shards wanted (default: every shard). For ``SHARD:LOCATION`` pairs, only the named shards
            among them are answered.

    Returns:
        shard -> location, sorted by shard.

    Raises:
        InvalidArgumentError: a named shard is out of range, a location is past its shard's head (it would
            skip cells written later), or a named shard is outside ``shards``.
        StorageError: a storage node cannot be read.
    """
    wanted = list(range(store.shard_count)) if shards is None else sorted({store.check_shard(s) for s in shards})
    if position.kind == "beginning":
        return dict.fromkeys(wanted, 0)
    if position.kind == "end":
        return store.heads(wanted)
    if position.kind == "time":
        assert position.when is not None
        return store.locations_at(position.when, wanted)
    chosen = set(wanted)
    named = {store.check_shard(shard): int(location) for shard, location in position.locations.items()}
    outside = sorted(set(named) - chosen)
    if outside:
        raise InvalidArgumentError(f"position: shard {outside[0]} is named but not among the shards chosen")
    heads = store.heads(named)
    for shard, location in sorted(named.items()):
        if location > heads[shard]:
            raise InvalidArgumentError(f"position: {shard}:{location} is past the shard's head ({heads[shard]}): "
                                       "cells written there later would be skipped")
    return dict(sorted(named.items()))



def check_range(start: Position, until: Position) -> None:
    """Refuse a range that ends before it starts where both ends are written alike (two times, or a shard's two
    locations), or that ends at the beginning: it would hold nothing, which is not what an operator meant.

    Raises:
        InvalidArgumentError: naming both ends.
    """
    if until.kind == "beginning":
        raise InvalidArgumentError("--until beginning: the range would hold nothing")
    if start.kind == until.kind == "time" and until.when is not None and start.when is not None \
            and until.when < start.when:
        raise InvalidArgumentError(f"--until {until} is before --from {start}: the range would hold nothing")
    if start.kind == until.kind == "locations":
        for shard, location in sorted(until.locations.items()):
            if location < start.locations.get(shard, 0):
                raise InvalidArgumentError(f"--until {shard}:{location} is before --from {shard}:"
                                           f"{start.locations[shard]}: the range would hold nothing")
