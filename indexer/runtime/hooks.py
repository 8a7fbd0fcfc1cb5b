"""Hooks: what an app keeps beside its handlers, told of the app's moments (and of its handlers' retries).

A feature that needs more than a handler (the secondary indexes: register their versions as live
when the app starts, measure their lag while it runs) subclasses :class:`Hook` and is added with
:meth:`App.add_hook <indexer.runtime.app.App.add_hook>`; the runtime knows hooks, never the features.

>>> class Heartbeat(Hook):                                   # doctest: +SKIP
...     interval = 10.0
...     def tick(self) -> None:
...         logger.info("still running")
>>> app.add_hook(Heartbeat())                                # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from logstore import Cell


class Hook:
    """Called by an app while it serves (``drain`` or ``run``). :meth:`started` and :meth:`tick` are blocking:
    each call runs in a worker thread, so they may do I/O; :meth:`retrying` runs on the event loop."""

    interval: float | None = None
    """Seconds between :meth:`tick` calls while the app serves; None: never."""

    def started(self) -> None:
        """Once each time the app starts serving, after its source started and before it waits for the end.
        An exception stops the app: it is raised by ``drain``/``run``."""

    def tick(self) -> None:
        """Every :attr:`interval` seconds while the app serves (the first right after :meth:`started`), never
        two at once. An exception is logged and serving goes on: a tick is upkeep, not delivery."""

    def retrying(self, handler: str, cells: Sequence[Cell], attempt: int, error: BaseException,
                 delay: float) -> None:
        """Attempt ``attempt`` of ``handler`` at ``cells`` (one cell, or a batch) raised ``error``; the next
        attempt comes after ``delay`` seconds. Called on the event loop, so it must not block: it is for
        counting and recording (:class:`indexer.testing.AppHarness` keeps the retries a test asserts on).
        An exception here is logged and ignored."""
