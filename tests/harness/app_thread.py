"""An app running in a thread of the test, on an event loop of its own, until the test's block ends."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

from indexer import App


@dataclasses.dataclass
class RunningApp:
    thread: threading.Thread
    failed: list[BaseException]  # what ended run_async early, if anything


@contextlib.contextmanager
def app_in_thread(app: App, name: str, join: float = 30.0) -> Iterator[RunningApp]:
    """Run ``app.run_async`` in a thread named ``name``; at the block's end, stop it and wait ``join`` seconds."""
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    failed: list[BaseException] = []

    def serve() -> None:
        async def until_stopped() -> None:
            stop = asyncio.Event()
            running.append((asyncio.get_running_loop(), stop))
            await app.run_async(stop)
        try:
            asyncio.run(until_stopped())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=serve, name=name)
    thread.start()
    try:
        yield RunningApp(thread, failed)
    finally:
        deadline = time.monotonic() + 10  # a block that ends at once: the loop may not run yet
        while not running and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if running:
            loop, stop = running[0]
            loop.call_soon_threadsafe(stop.set)
        thread.join(join)
