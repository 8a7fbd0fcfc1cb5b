"""The app: handlers on the cell stream, at least once, with retries and a dead-letter queue.

>>> app = App("billing", store="sqlite:///data")             # doctest: +SKIP
>>> @app.trigger("BASE", max_attempts=5)                      # doctest: +SKIP
... def bill_rider(cell): ...
>>> app.drain(timeout=60)                                     # doctest: +SKIP
Counts(processed=..., retried=..., dead_lettered=...)

Direct mode (no ``brokers``) tails the logstore (:mod:`indexer.runtime.direct`), embedded
(offsets in the store) or shared between processes through ZooKeeper. Kafka mode
(``brokers="host:port"``) consumes the tailer's topics with aiokafka's consumer group
(:mod:`indexer.runtime.kafka`), sharing partitions through the consumer group ``app.<name>``;
the store is still needed there, for the dead letters. Every mode runs the same
:class:`~indexer.runtime.handlers.Processor`, so retries, dead letters and the stall
threshold behave alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import ValidationError

import logstore
from indexer.errors import ConfigurationError, DrainTimeoutError, TakenOverError
from indexer.runtime.clock import SYSTEM_CLOCK, Clock
from indexer.runtime.collector import streaming_collector
from indexer.runtime.config import AppConfig
from indexer.runtime.context import Context, takes_context, with_context
from indexer.runtime.dlq_store import DeadLetterStore
from indexer.runtime.dlq_triage import DeadLetterQueue
from indexer.runtime.handlers import BatchApplier, Counts, Handler, Processor, Trigger
from indexer.runtime.hooks import Hook
from indexer.runtime.metrics import AppMetrics
from indexer.runtime.redrive import PolicyStore, RedrivePolicy, Redriver
from logstore import Cell, InvalidCellError, Store
from logstore.cell import check_column
from logstore.extras import require
from tailer.metrics import TailerMetrics

if TYPE_CHECKING:
    from indexer.indexes.definitions import IndexDefinition

logger = logging.getLogger(__name__)
_WATCH = 0.01  # between looks at a drain's end (and at failures) while draining
_RUN_WATCH = 0.1  # between looks at failures while running: the stop event wakes the loop at once
H = TypeVar("H", bound=Callable[..., Any])  # a handler, returned as given by the decorator
B = TypeVar("B", bound=Callable[..., Any])


class Runner(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def failed(self) -> BaseException | None: ...
    def lost_shards(self) -> frozenset[int]: ...
    def caught_up(self, since: float) -> bool: ...


class App:
    """A stream-processing app named ``name`` over the logstore at ``store`` (a URL, path or Store)."""

    def __init__(self, name: str, store: str | Store, brokers: str | None = None, *, clock: Clock = SYSTEM_CLOCK,
                 redrive: RedrivePolicy | Mapping[str, Any] | None = None, **options: Any) -> None:
        """Describe the app; nothing is opened until it is first used (a URL or path store opens then).

        Args:
            name: the app's name: its offsets, dead letters and consumer group live under it, and processes
                of the same name share the shards (or partitions).
            store: the logstore, as a URL or path, or an open :class:`~logstore.Store` (which the app does
                not close).
            brokers: ``host:port[,host:port...]`` for Kafka mode (the tailer's topics); None for direct mode.
            clock: the time the handlers' backoff waits on and their dead letters are dated by.
            redrive: the app's redrive policy (:class:`~indexer.runtime.redrive.RedrivePolicy` or its fields):
                the app hands its matching dead letters back to their handler by itself; seeded into the store
                when the app starts, where an operator's change wins (docs/indexer.md, Redrive policies).
            **options: the fields of :class:`~indexer.runtime.config.AppConfig` (``zookeeper``,
                ``stall_threshold``, ``concurrency``, ``page_size``, ...).

        Raises:
            ConfigurationError: an option is unknown or out of range, or does not fit the mode
                (``zookeeper`` or a start time with ``brokers``, ``kafka`` without them).
            InvalidPolicyError: ``redrive`` is not a valid policy (a ConfigurationError).
        """
        self.redrive_policy = None if redrive is None else RedrivePolicy.parse(redrive)
        try:
            self.config = AppConfig(name=name, **options)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ConfigurationError(f"app option {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        if brokers is not None:
            if not isinstance(brokers, str) or not brokers.strip():
                raise ConfigurationError(f"brokers must be 'host:port[,host:port...]', got {brokers!r}")
            if self.config.zookeeper:
                raise ConfigurationError("zookeeper= is for direct mode; in Kafka mode the consumer group "
                                         "shares the partitions")
            if self.config.start_from not in ("beginning", "now"):
                raise ConfigurationError("Kafka mode starts a new consumer group at the beginning or now, "
                                         "not at a time")
        elif "kafka" in options:
            raise ConfigurationError("kafka= (TLS and SASL) is for Kafka mode: give brokers= too, or drop it")
        self.name = name
        self.brokers = brokers
        self._target = store
        self._store: Store | None = store if isinstance(store, Store) else None
        self.clock = clock  # the handlers' backoff waits on it and their failures are dated by it
        self.triggers: list[Trigger] = []
        self.hooks: list[Hook] = []
        self._serving = False
        self.metrics = AppMetrics(name)
        self.source_metrics = TailerMetrics(f"app.{name}", registry=self.metrics.registry)
        self._processor: Processor | None = None

    # -- handlers -------------------------------------------------------------
    def trigger(self, column: str, *, max_attempts: int = 5, name: str | None = None) -> Callable[[H], H]:
        """Run the decorated function (sync or async) on every cell written to ``column``: ``fn(cell)``, or
        ``fn(cell, ctx)`` for one that wants its :class:`~indexer.runtime.context.Context` (the app's store).

        Args:
            column: the column whose cells the handler takes.
            max_attempts: attempts at a cell (with the app's backoff between them) before it is dead-lettered.
            name: the handler's name, in its dead letters and metrics; by default the function's name.

        Returns:
            A decorator that registers the function and returns it unchanged.

        Raises:
            ConfigurationError: a bad column or ``max_attempts``; when the decorator is applied, a handler of
                that name exists already, or the app has started.
        """
        self._check_trigger("trigger", column, max_attempts)

        def register(fn: H) -> H:
            handler = self._handler_name(name, fn)
            call = with_context(fn, Context(self, handler)) if takes_context(fn, "handler") else fn
            self._add_trigger(Trigger(handler, column, call, max_attempts))
            return fn
        return register

    def batch_trigger(self, column: str, *, max_attempts: int = 5,
                      name: str | None = None) -> Callable[[B], B]:
        """Run the decorated function (sync or async) on the cells written to ``column``, a list at a time: the
        consecutive cells of one shard (direct mode) or partition (Kafka mode), in order, up to ``page_size``.

        ``fn(cells)``, or ``fn(cells, ctx)`` for one that wants its :class:`~indexer.runtime.context.Context`;
        a sync one takes one trip to the thread pool per list. The list is retried whole under the retry
        policy; if it still fails, its cells are passed one at a time (``[cell]``), so only the cells that
        fail are dead-lettered (and a dead letter's replay passes its one cell).

        Args:
            column: the column whose cells the handler takes.
            max_attempts: attempts at a list (then at each of its cells) before a cell is dead-lettered.
            name: the handler's name, in its dead letters and metrics; by default the function's name.

        Returns:
            A decorator that registers the function and returns it unchanged.

        Raises:
            ConfigurationError: as :meth:`trigger`.
        """
        self._check_trigger("batch trigger", column, max_attempts)

        def register(fn: B) -> B:
            handler = self._handler_name(name, fn)
            batch = with_context(fn, Context(self, handler)) if takes_context(fn, "batch handler") else fn
            one: Handler
            if inspect.iscoroutinefunction(batch):
                async def one(cell: Cell) -> None:
                    await batch([cell])
            else:
                def one(cell: Cell) -> None:
                    batch([cell])
            self._add_trigger(Trigger(handler, column, one, max_attempts, batch=batch))
            return fn
        return register

    @staticmethod
    def _check_trigger(what: str, column: str, max_attempts: int) -> None:
        try:
            check_column(column)
        except InvalidCellError as exc:
            raise ConfigurationError(f"{what} column: {exc}") from None
        if type(max_attempts) is not int or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")

    @staticmethod
    def _handler_name(name: str | None, fn: Callable[..., Any]) -> str:
        return name or getattr(fn, "__name__", None) or repr(fn)

    def _add_trigger(self, trigger: Trigger) -> None:
        if any(t.name == trigger.name for t in self.triggers):
            raise ConfigurationError(f"app {self.name} already has a handler named {trigger.name}")
        if self._processor is not None:
            raise ConfigurationError("add triggers before the app starts")
        self.triggers.append(trigger)

    def index(self, definitions: str | Path | Sequence[IndexDefinition]) -> list[IndexDefinition]:
        """Keep the indexes of a YAML file (or these definitions) current.

        Each version is registered in the index catalog (its tables created) if new; a version that
        exists must have the same definition. Every version of these indexes that is not dropped is
        kept current, the ones the file no longer lists included (an active one must not go stale).

        Args:
            definitions: the path of an indexes YAML file (docs/indexes.md), or the definitions themselves.

        Returns:
            The index versions the app keeps current.

        Raises:
            ConfigurationError: the app has started, the file is invalid (a ConfigFileError naming the line),
                or a registered version has another definition.
        """
        if self._processor is not None:
            raise ConfigurationError("add indexes before the app starts")
        from indexer.indexes.keeper import keep  # the index feature, plugged in through a batch handler and a hook

        return keep(self, definitions)

    def add_hook(self, hook: Hook) -> None:
        """Tell ``hook`` of the app's moments (see :class:`~indexer.runtime.hooks.Hook`)."""
        if self._processor is not None:
            raise ConfigurationError("add hooks before the app starts")
        self.hooks.append(hook)

    def batch_handler(self, name: str, column: str, applier: BatchApplier, one: Handler, *,
                      max_attempts: int = 5) -> None:
        """Hand ``column``'s cells to ``applier`` in batches (see :class:`~indexer.runtime.handlers.BatchApplier`);
        ``one`` takes a single cell: a dead letter's replay, or the cells of a batch that failed, one by one."""
        if self._processor is not None:
            raise ConfigurationError("add handlers before the app starts")
        try:
            check_column(column)
        except InvalidCellError as exc:
            raise ConfigurationError(f"handler column: {exc}") from None
        if any(t.name == name for t in self.triggers):
            raise ConfigurationError(f"app {self.name} already has a handler named {name}")
        self.triggers.append(Trigger(name, column, one, max_attempts, applier))

    # -- shared parts -----------------------------------------------------------
    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = logstore.open(str(self._target))
        return self._store

    @property
    def store_target(self) -> str | Store:
        """The store the app was given: a URL or path (opened on first use), or an open Store."""
        return self._target

    def open_existing_store(self) -> Store:
        """Open the app's store now, refusing (StoreNotFoundError) to create it when there is none: for
        commands that triage or resume an app, where a missing store means a wrong path, not a new app."""
        if self._store is None:
            self._store = logstore.open(str(self._target), create=False)
        return self._store

    @property
    def processor(self) -> Processor:
        if self._processor is None:
            if not self.triggers:
                raise ConfigurationError(f"app {self.name} has no triggers")
            self._processor = Processor(self.config, self.triggers,
                                        DeadLetterStore(self.store, self.name, self.clock), self.metrics, self.hooks)
        return self._processor

    @property
    def dlq(self) -> DeadLetterQueue:
        """The app's dead letters: list, stats, show, replay, discard."""
        return DeadLetterQueue(DeadLetterStore(self.store, self.name, self.clock), lambda: self.processor)

    @contextlib.contextmanager
    def substituted(self, store: Store, clock: Clock | None = None, hooks: Sequence[Hook] = ()) -> Iterator[App]:
        """Inside the block the app runs over ``store`` and on ``clock``, with ``hooks`` added, in direct mode
        without ZooKeeper, every shard from the beginning; afterwards it is as it was. For tests
        (:class:`indexer.testing.AppHarness`): an app built at import time reaches the test's store through
        its handlers' context or ``app.store``. Another store is refused for an app with appliers (indexes,
        sinks), which were built over their store or warehouse when added: build such an app over the test's
        store instead. Refused while the app serves."""
        if self._serving:
            raise ConfigurationError(f"app {self.name} is serving; substitute its store before it starts")
        bound = [t.name for t in self.triggers if t.applier is not None]
        if bound and store is not self._store:
            raise ConfigurationError(f"app {self.name} has handlers built over their destination ({', '.join(bound)}); "
                                     "build the app over the test's store instead")
        saved = (self._target, self._store, self.brokers, self.config, self.clock, self.hooks)
        self._drop_processor()
        self._target = self._store = store
        self.brokers = None
        self.config = self.config.model_copy(update={"zookeeper": None, "zookeeper_auth": None,
                                                     "start_from": "beginning"})
        self.clock = clock or self.clock
        self.hooks = [*self.hooks, *hooks]
        try:
            yield self
        finally:
            self._drop_processor()
            self._target, self._store, self.brokers, self.config, self.clock, self.hooks = saved

    def _drop_processor(self) -> None:
        if self._processor is not None:
            self._processor.close()
            self._processor = None

    def _runner(self) -> Runner:
        processor = self.processor
        if self.brokers is not None:
            require("kafka", "an app in Kafka mode")
            from indexer.runtime.kafka import KafkaRunner  # aiokafka is imported only in Kafka mode

            return KafkaRunner(self.config, self.brokers, processor, self.metrics)
        from indexer.runtime.direct import DirectRunner  # the tailer's worker is imported only in direct mode

        return DirectRunner(self.store, self.config, processor, self.source_metrics)

    # -- running ----------------------------------------------------------------
    def drain(self, timeout: float = 60) -> Counts:
        """Process every cell now in the log (of the shards or partitions this process gets), then stop.

        Args:
            timeout: seconds to reach the end before giving up.

        Returns:
            What this drain processed, retried and dead-lettered.

        Raises:
            HandlerStalledError: a handler reached the stall threshold (its cell stays unacknowledged).
            DrainTimeoutError: ``timeout`` passed first (with the counts so far).
            TakenOverError: another process of the app took this one's shards over.
            ConfigurationError: the app has no handler, or is serving already.
            SourceUnavailableError: in Kafka mode, the cluster cannot be reached.
        """
        with streaming_collector():
            return asyncio.run(self.drain_async(timeout))

    async def drain_async(self, timeout: float = 60) -> Counts:
        """:meth:`drain` inside a running event loop (the same arguments, result and errors)."""
        return await self._serve(lambda runner, since: runner.caught_up(since), timeout)

    def run(self, metrics_port: int | None = None) -> None:
        """Run until SIGTERM or SIGINT, then stop gracefully: handlers under way finish, positions are committed.

        Args:
            metrics_port: serve the Prometheus metrics on this port while running; None serves none.

        Raises:
            HandlerStalledError, TakenOverError, ConfigurationError, SourceUnavailableError: as :meth:`drain`,
                after the app has stopped.
        """
        if metrics_port is not None:
            self.metrics.serve(metrics_port)
        with streaming_collector():
            asyncio.run(self.run_async())

    async def run_async(self, stop: asyncio.Event | None = None) -> None:
        """:meth:`run` inside a running event loop.

        Args:
            stop: run until it is set; None runs until SIGTERM or SIGINT (handlers installed on the loop).

        Raises:
            HandlerStalledError, TakenOverError, ConfigurationError, SourceUnavailableError: as :meth:`run`.
        """
        event = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = [] if stop is not None else [signal.SIGTERM, signal.SIGINT]
        for sig in signals:
            loop.add_signal_handler(sig, event.set)
        try:
            await self._serve(lambda _runner, _since: event.is_set(), None, event)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    async def _serve(self, done: Callable[[Runner, float], bool], timeout: float | None,
                     stop: asyncio.Event | None = None) -> Counts:
        if self._serving:
            raise ConfigurationError(f"app {self.name} is serving already")
        self._serving = True
        try:
            return await self._serve_once(done, timeout, stop)
        finally:
            self._serving = False

    async def _serve_once(self, done: Callable[[Runner, float], bool], timeout: float | None,
                          stop: asyncio.Event | None) -> Counts:
        """Serve until ``done``: looked at every _WATCH seconds (a drain), or, given the ``stop`` event that makes
        it true, when it is set or every _RUN_WATCH seconds (an idle app's loop is not woken a hundred times a
        second to look)."""
        processor = self.processor
        await asyncio.to_thread(processor.load_open_counts)
        processor.stalled = None
        for trigger in self.triggers:
            self.metrics.stalled.labels(self.name, trigger.name).set(0)
        before = processor.counts
        redriver = await self._redriver(processor)
        runner = self._runner()
        since = time.monotonic()
        deadline = None if timeout is None else since + timeout
        await runner.start()
        try:
            for hook in self.hooks:
                await asyncio.to_thread(hook.started)
        except BaseException:
            await runner.stop()
            raise
        ticks = _Ticks(self.hooks)
        recounts = asyncio.create_task(_recount_open(processor, self.config.dlq_recount_interval),
                                       name=f"{self.name}-recount-open")
        redrives = asyncio.create_task(redriver.run(), name=f"{self.name}-redrive")
        # One waiter for the whole run: wait_for() would make a task of stop.wait() and cancel it at every look.
        stopped = None if stop is None else asyncio.ensure_future(stop.wait())
        try:
            while not done(runner, since):
                ticks.due()
                if processor.stalled is not None:
                    raise processor.stalled
                failed = runner.failed()
                if failed is not None:
                    raise failed
                if runner.lost_shards():
                    raise TakenOverError(f"another process of app {self.name} took over "
                                         f"{len(runner.lost_shards())} shards; this one stops")
                if deadline is not None and time.monotonic() > deadline:
                    raise DrainTimeoutError(timeout or 0, processor.counts - before)
                if stopped is None:
                    await asyncio.sleep(_WATCH)
                else:
                    await asyncio.wait((stopped,), timeout=ticks.wait(_RUN_WATCH))
        finally:
            if stopped is not None:
                stopped.cancel()
            recounts.cancel()
            redriver.stop()  # a redrive under way finishes: its entry must not stay `replayed`
            await runner.stop()
            await ticks.finish()
            with contextlib.suppress(asyncio.CancelledError):
                await recounts
            await redrives
        if processor.stalled is not None:
            raise processor.stalled
        return processor.counts - before

    async def _redriver(self, processor: Processor) -> Redriver:
        """The redrive policy's task for this run, the app's declaration seeded into the store first (an
        operator's policy there wins). A store that does not answer now is logged: the task reads it later."""
        dlq = self.dlq
        try:
            await asyncio.to_thread(PolicyStore(dlq.deadletters).seed, self.redrive_policy)
        except Exception as exc:
            logger.warning("app %s: redrive policy not seeded: %s: %s", self.name, type(exc).__name__, exc)
        return Redriver(dlq, self.metrics, self.clock, [t.name for t in processor.triggers],
                        self.config.dlq_recount_interval)

    def close(self) -> None:
        """Release the thread pool and, if the app opened it, the store. Safe twice."""
        self._drop_processor()
        if self._store is not None and not isinstance(self._target, Store):
            with contextlib.suppress(Exception):
                self._store.close()
            self._store = None

    def __enter__(self) -> App:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ticks:
    """The hooks' ticks: each hook's in a worker thread every ``interval`` seconds, never two of one at once."""

    def __init__(self, hooks: list[Hook]) -> None:
        self._hooks = [hook for hook in hooks if hook.interval is not None]
        self._next = [time.monotonic()] * len(self._hooks)
        self._running: list[asyncio.Future[None] | None] = [None] * len(self._hooks)

    def due(self) -> None:
        now = time.monotonic()
        for i, hook in enumerate(self._hooks):
            running = self._running[i]
            if now >= self._next[i] and (running is None or running.done()):
                self._running[i] = asyncio.ensure_future(asyncio.to_thread(_tick, hook))
                self._next[i] = now + (hook.interval or 0)

    def wait(self, longest: float) -> float:
        """Seconds until the next hook is due, at most ``longest``."""
        now = time.monotonic()
        return max(0.0, min([longest, *(due - now for due in self._next)]))

    async def finish(self) -> None:
        await asyncio.gather(*(running for running in self._running if running is not None))


async def _recount_open(processor: Processor, interval: float) -> None:
    """Count the open dead letters again every ``interval`` seconds while the app serves."""
    while True:
        await asyncio.sleep(interval)
        try:
            await processor.recount_open()
        except Exception as exc:  # the store is down: the counts stay as they are until it answers
            logger.debug("open dead letters not counted: %s: %s", type(exc).__name__, exc)


def _tick(hook: Hook) -> None:
    try:
        hook.tick()
    except Exception:
        logger.exception("hook %s: tick failed; the app goes on", type(hook).__name__)
