"""Writers at a fixed rate and the latencies they see, shared by the latency benchmarks."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import logstore

WRITERS = 8  # a durable put takes a few milliseconds here, so several writers share the rate


def paced_puts(store: logstore.Store, column: str, rate: float, seconds: float,
               body: Callable[[int], dict[str, Any]]) -> dict[str, float]:
    """Put cells at ``rate`` per second for ``seconds``; {row_key: time.time() when put_cell returned}."""
    put_at: dict[str, float] = {}
    stop = threading.Event()

    def write() -> None:
        next_at, i = time.perf_counter(), 0
        while not stop.is_set():
            key = uuid.uuid4()
            store.put_cell(key, column, 1, body(i))
            put_at[str(key)] = time.time()
            i += 1
            next_at += WRITERS / rate
            time.sleep(max(0.0, next_at - time.perf_counter()))

    writers = [threading.Thread(target=write, daemon=True) for _ in range(WRITERS)]
    for writer in writers:
        writer.start()
    time.sleep(seconds)
    stop.set()
    for writer in writers:
        writer.join()
    return put_at


def latencies(put_at: dict[str, float], got: dict[str, float], who: str) -> list[float]:
    """Milliseconds from each put to its receipt, in put order, the warm-up tenth dropped."""
    samples = [(got[key] - at) * 1000 for key, at in sorted(put_at.items(), key=lambda kv: kv[1]) if key in got]
    missing = len(put_at) - len(samples)
    if missing:
        print(f"   {who}: {missing} cells not received within the window", flush=True)
    return samples[len(samples) // 10:]
