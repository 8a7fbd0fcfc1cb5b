"""The garbage collector's thresholds while a streaming loop runs (App.run, App.drain; cellstream run, tail).

Each cell leaves a few container objects behind (its tuple, its body, its UUID), and the default thresholds
(700, 10, 10) collect far too often for that (measured in docs/benchmarks.md, Kafka mode against Quix
Streams). Reference cycles are still collected, less often.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

STREAMING_GC_THRESHOLDS = (50_000, 20, 20)


@contextlib.contextmanager
def streaming_collector() -> Iterator[None]:
    """:data:`STREAMING_GC_THRESHOLDS` for the duration, then the thresholds as they were (a caller that tuned
    its process already keeps the higher first threshold)."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], STREAMING_GC_THRESHOLDS[0]), *STREAMING_GC_THRESHOLDS[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
