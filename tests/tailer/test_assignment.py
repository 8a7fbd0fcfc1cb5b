"""The leader's shard assignment: balanced, sticky, deterministic."""

from __future__ import annotations

import random

from tailer.coordinators.assignment import balance


def loads(owners: dict[int, str], workers: list[str]) -> list[int]:
    return [sum(1 for w in owners.values() if w == worker) for worker in workers]


def test_every_shard_gets_exactly_one_live_worker_and_loads_differ_by_at_most_one() -> None:
    rng = random.Random(7)
    for _ in range(200):
        shards = rng.randint(1, 300)
        workers = [f"w{i}" for i in range(rng.randint(1, 12))]
        current = {s: rng.choice([*workers, "gone"]) for s in range(shards) if rng.random() < 0.7}
        owners = balance(range(shards), workers, current)
        assert sorted(owners) == list(range(shards))
        assert set(owners.values()) <= set(workers)
        counts = loads(owners, workers)
        assert max(counts) - min(counts) <= 1


def test_adding_a_worker_moves_only_its_share() -> None:
    workers = ["a", "b", "c"]
    first = balance(range(4096), workers, {})
    second = balance(range(4096), [*workers, "d"], first)
    moved = [s for s in first if first[s] != second[s]]
    assert len(moved) == 1024
    assert all(second[s] == "d" for s in moved)


def test_a_dead_workers_shards_are_spread_and_nobody_elses_move() -> None:
    first = balance(range(90), ["a", "b", "c"], {})
    second = balance(range(90), ["a", "c"], first)
    assert all(second[s] == first[s] for s in first if first[s] != "b")
    assert loads(second, ["a", "c"]) == [45, 45]


def test_the_same_inputs_give_the_same_assignment() -> None:
    current = {s: "a" for s in range(10)}
    assert balance(range(16), ["b", "a"], current) == balance(range(16), ["a", "b"], current)


def test_no_workers_means_no_owners() -> None:
    assert balance(range(8), [], {1: "a"}) == {}
