"""The storage nodes' health as a worker node reports it (``/readyz``, ``/metrics``): checked in the background,
on threads of its own, so that an answer never waits for a node that does not answer.

Each node is checked every ``interval`` seconds, one check at a time per node: a read of its metadata, tried
for ``timeout`` seconds (a replica answers for a primary that is down, as reads fall back to it). A node whose
check has run longer than ``timeout`` is reported as not answering, whatever it answered before: a node that
hangs (a connection that stops forwarding) is not ready, and no thread waits for it to say so. ``/readyz``
starts the checks that are not running and waits at most ``timeout`` for them; ``/metrics`` reads what the
checks found, and the store's job records as the last background read found them: a scrape makes no call
to a storage node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from logstore.errors import LogstoreError, StorageUnavailableError
from logstore.store import Store

logger = logging.getLogger(__name__)
MAX_THREADS = 64  # one check at a time per node: threads for this many nodes checked at once


class CachedCollector(Collector):
    """The metrics of ``source`` as :meth:`refresh` last collected them: a scrape yields them without calling
    ``source`` (whose collect may read a storage node)."""

    def __init__(self, source: Collector) -> None:
        self.source = source
        self._families: list[Metric] = []

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked, as the source's families change from one collect to the next

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)

    def refresh(self) -> None:
        """Collect ``source`` now (blocking: on a thread of the checks). A collect that yields nothing keeps the
        last families: the job records' collector yields nothing when it cannot read them."""
        families = list(self.source.collect())
        if families or not self._families:
            self._families = families


class NodeHealth:
    """What each storage node answered its last background check.

    Args:
        store: the worker node's store; its nodes are the map's, read at each round (nodes join and leave).
        interval: seconds between the rounds of checks.
        timeout: seconds a check is tried, and after which a node whose check has not finished is reported
            as not answering; also the longest :meth:`check` waits.
        on_round: called on the event loop with :meth:`answers` whenever a check finishes or a round starts
            (the gauges).
        cached: collectors refreshed in the background at each round, one refresh at a time.
    """

    def __init__(self, store: Store, *, interval: float, timeout: float,
                 on_round: Callable[[dict[str, str]], None], cached: list[CachedCollector] | None = None) -> None:
        self.store = store
        self.interval = interval
        self.timeout = timeout
        self._on_round = on_round
        self._cached = cached or []
        self._policy = store.options.retry.model_copy(update={"deadline": timeout})
        self._answers: dict[str, str] = {}  # node -> "ok" or what its last finished check raised
        self._running: dict[str, tuple[float, asyncio.Future[None]]] = {}  # node -> (started, its check)
        self._refresh: asyncio.Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the rounds; the first one's checks are awaited (at most ``timeout``), so a /readyz right after
        start answers what the nodes said."""
        if self._task is not None:
            return
        self._pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="worker-node-health")
        await self.check()
        if self._refresh is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._refresh), self.timeout)
        self._task = asyncio.create_task(self._rounds(), name="worker-node-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)  # a check stuck on a node is not waited for

    async def _rounds(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._start_checks()
            self._on_round(self.answers())

    async def check(self) -> dict[str, str]:
        """Start the checks not running, wait for the running ones at most ``timeout``; :meth:`answers`."""
        self._start_checks()
        running = [future for _, future in self._running.values()]
        if running:
            await asyncio.wait(running, timeout=self.timeout)
        answers = self.answers()
        self._on_round(answers)
        return answers

    def answers(self) -> dict[str, str]:
        """``{node: "ok" or why not}`` for every node of the store, from the checks made so far."""
        now = time.monotonic()
        out: dict[str, str] = {}
        for node in self.store.nodes:
            running = self._running.get(node)
            if running is not None and now - running[0] > self.timeout:
                out[node] = f"storage node {node} has not answered its check for {now - running[0]:.1f} s"
            else:
                out[node] = self._answers.get(node, f"storage node {node} has not been checked yet")
        return out

    def _start_checks(self) -> None:
        if self._pool is None:
            return
        loop = asyncio.get_running_loop()
        nodes = self.store.nodes
        for gone in set(self._answers) - set(nodes):
            del self._answers[gone]
        for node in nodes:
            if node in self._running:
                continue
            future = loop.run_in_executor(self._pool, self._check_one, node)
            self._running[node] = (time.monotonic(), future)
            future.add_done_callback(partial(self._finished, node))
        if self._cached and self._refresh is None:
            self._refresh = loop.run_in_executor(self._pool, self._refresh_cached)
            self._refresh.add_done_callback(self._refreshed)

    def _check_one(self, node: str) -> None:
        recorder = self.store.node_recorder(node)
        if recorder is None:
            raise StorageUnavailableError(f"storage node {node} is not open in this process")
        recorder.read_meta(self._policy)

    def _finished(self, node: str, done: asyncio.Future[None]) -> None:
        self._running.pop(node, None)
        if done.cancelled():
            return
        error = done.exception()
        if error is None:
            self._answers[node] = "ok"
        elif isinstance(error, LogstoreError):
            self._answers[node] = str(error)
        else:  # a bug, not a node's answer: logged, and the node reported as not checked
            logger.error("checking storage node %s failed unexpectedly", node, exc_info=error)
            self._answers[node] = f"storage node {node} could not be checked (the worker node's log says why)"
        self._on_round(self.answers())

    def _refresh_cached(self) -> None:
        for collector in self._cached:
            try:
                collector.refresh()
            except LogstoreError as exc:  # kept as last collected
                logger.warning("metrics of %s not refreshed: %s", type(collector.source).__name__, exc)

    def _refreshed(self, done: asyncio.Future[None]) -> None:
        self._refresh = None
        if not done.cancelled() and (error := done.exception()) is not None:
            logger.error("refreshing the worker node's metrics failed unexpectedly", exc_info=error)
