"""Balanced, sticky assignment of shards to workers (computed by the leader).

Balanced: every worker gets ``floor(S/W)`` or ``ceil(S/W)`` shards. Sticky: a shard
stays with its worker unless that worker left or holds more than its share, so
adding or removing a worker moves only about ``S/W`` shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def balance(shards: Iterable[int], workers: Sequence[str], current: Mapping[int, str]) -> dict[int, str]:
    """The new owner of every shard, given the live ``workers`` and the ``current`` owners."""
    shard_list = sorted(set(shards))
    if not workers:
        return {}
    alive = set(workers)
    kept: dict[str, list[int]] = {w: [] for w in workers}
    pool: list[int] = []
    for shard in shard_list:
        owner = current.get(shard)
        if owner in alive:
            kept[owner].append(shard)
        else:
            pool.append(shard)
    base, extra = divmod(len(shard_list), len(workers))
    # The workers already holding the most get the extra slots, so fewer shards move.
    ranked = sorted(workers, key=lambda w: (-len(kept[w]), w))
    capacity = {w: base + (1 if i < extra else 0) for i, w in enumerate(ranked)}
    for worker in ranked:
        held = kept[worker]
        if len(held) > capacity[worker]:
            pool.extend(held[capacity[worker]:])
            del held[capacity[worker]:]
    pool.sort()
    result = {shard: w for w, held in kept.items() for shard in held}
    for worker in sorted(workers, key=lambda w: (len(kept[w]), w)):
        room = capacity[worker] - len(kept[worker])
        for shard in pool[:room]:
            result[shard] = worker
        del pool[:room]
    return result


def by_worker(owners: Mapping[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for shard, worker in sorted(owners.items()):
        out.setdefault(worker, []).append(shard)
    return out
