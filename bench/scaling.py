"""The shard-count comparison shared by the benches: the same drain at two shard counts, in rounds."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def compare_shard_counts(what: str, cells: int, base: int, shards: int, rounds: int, target: float,
                         drain: Callable[[int, int], float]) -> dict[str, Any]:
    """``drain(shard_count, round)`` (its seconds) at ``base`` and at ``shards`` shards, ``rounds`` times,
    alternating which goes first; prints and returns the rates of the best rounds and their ratio."""
    seconds: dict[int, list[float]] = {base: [], shards: []}
    for r in range(rounds):
        for n in (base, shards) if r % 2 == 0 else (shards, base):
            seconds[n].append(drain(n, r))
    # The best round of each: on a shared machine a round is only ever slowed down by others.
    rate = {n: cells / min(s) for n, s in seconds.items()}
    median = {n: cells / statistics.median(s) for n, s in seconds.items()}
    ratio = rate[shards] / rate[base]
    print(f"{what}, {cells} cells: {rate[base]:.0f} cells/s at {base} shards, {rate[shards]:.0f} at {shards}:"
          f" ratio {ratio:.2f} (target >= {target}: {'met' if ratio >= target else 'MISSED'})", flush=True)
    return {"cells": cells, "cells_per_s": {str(n): round(r) for n, r in rate.items()},
            "median_cells_per_s": {str(n): round(r) for n, r in median.items()},
            "seconds": {str(n): s for n, s in seconds.items()}, "ratio": round(ratio, 3)}
