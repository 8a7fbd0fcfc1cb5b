"""Rebalance plans: which shards to move between storage nodes so that each holds about its share.

A plan is computed from each shard's weight (its cells, its bytes or its recent writes) and where it is; it
moves few shards: each move takes, from the heaviest node to the lightest, the shard whose weight is nearest
half the gap between the two (it narrows the gap most), and moves each shard at most once, so big shards go
first and a plan over 4096 shards needs about as many moves as the imbalance is worth, not one per shard. A node
being drained (``away``) gives all its shards to the others, lightest node first; a new, empty node receives
until it holds its share. An instance that holds no cell yet spreads its shards by count. Like Citus's
``get_rebalance_table_shards_plan``, the plan is only advice until a job carries it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from logstore.errors import InvalidArgumentError


class Move(NamedTuple):
    """One shard's move: from ``source`` to ``target``, ``weight`` (what the plan weighed) with it."""

    shard: int
    source: str
    target: str
    weight: int


class Plan(NamedTuple):
    """The moves, and each node's weight before and after them."""

    moves: list[Move]
    before: dict[str, int]
    after: dict[str, int]

    @property
    def spread(self) -> int:
        """The heaviest node's weight less the lightest's, after the moves."""
        return max(self.after.values()) - min(self.after.values()) if self.after else 0


def plan_rebalance(shards: Iterable[tuple[int, str, int]], nodes: Sequence[str], *,
                   away: Iterable[str] = (), max_moves: int | None = None) -> Plan:
    """The moves that even out ``nodes`` (see the module docstring).

    Args:
        shards: (shard, node holding it, weight) for every shard.
        nodes: the storage nodes that may hold shards after the plan (a new, empty one among them).
        away: nodes to empty (a drain): every shard they hold moves to one of ``nodes``.
        max_moves: stop after this many moves (None: as many as narrow the spread).

    Returns:
        The plan; its moves in the order to run them.

    Raises:
        InvalidArgumentError: no node to move to, a node both kept and drained, or a shard on a node that is
            neither.
    """
    kept = list(dict.fromkeys(nodes))
    leaving = set(away)
    if not kept:
        raise InvalidArgumentError("a rebalance needs at least one storage node to hold the shards")
    if leaving & set(kept):
        raise InvalidArgumentError(f"node {sorted(leaving & set(kept))[0]} is both drained and kept")
    held: dict[str, dict[int, int]] = {node: {} for node in [*kept, *sorted(leaving)]}
    for shard, node, weight in shards:
        if node not in held:
            raise InvalidArgumentError(f"shard {shard} is on node {node!r}, which the plan neither keeps nor drains")
        held[node][shard] = weight
    load = {node: sum(found.values()) for node, found in held.items()}
    before = dict(load)
    moves: list[Move] = []
    moved: set[int] = set()

    def move(shard: int, source: str, target: str) -> None:
        weight = held[source].pop(shard)
        held[target][shard] = weight
        load[source] -= weight
        load[target] += weight
        moves.append(Move(shard, source, target, weight))
        moved.add(shard)

    for source in sorted(leaving):  # a drain first: every shard goes, heaviest first, to the lightest node
        for shard, _ in sorted(held[source].items(), key=lambda item: (-item[1], item[0])):
            move(shard, source, min(kept, key=lambda n: (load[n], len(held[n]), n)))
    while max_moves is None or len(moves) < max_moves:
        heavy = max(kept, key=lambda n: (load[n], len(held[n]), n))
        light = min(kept, key=lambda n: (load[n], len(held[n]), n))
        gap = load[heavy] - load[light]
        # A shard weighing less than the gap narrows it; at most half of it keeps heavy the heavier one.
        fitting = [(w, s) for s, w in held[heavy].items() if 0 < w < gap and s not in moved]  # each moves once
        if not fitting:
            # A new instance (no cell anywhere yet) spreads its shards by count: moving them costs nothing now.
            if not any(load.values()):
                most = max(kept, key=lambda n: (len(held[n]), n))
                least = min(kept, key=lambda n: (len(held[n]), n))
                spare = sorted(set(held[most]) - moved)
                if len(held[most]) - len(held[least]) > 1 and spare:
                    move(spare[0], most, least)
                    continue
            break
        # Any of them lowers the sum of squared loads; the one nearest half the gap narrows it most.
        _, shard = min(fitting, key=lambda pair: (abs(gap - 2 * pair[0]), -pair[0], pair[1]))
        move(shard, heavy, light)
    return Plan(moves, before, {node: load[node] for node in kept})

