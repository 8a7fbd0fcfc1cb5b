"""Kafka mode: the app consumes the tailer's topics as a faust-streaming app.

The faust app (id ``app.<name>``, which is also its consumer group) subscribes to
``<prefix>.<column>`` for every column with a handler, and to the tailer's
``<prefix>-deadletter`` topic so that a cell the tailer could not publish reaches
the DLQ of each handler of its column instead of vanishing. Processes started with
the same app name share the partitions through the consumer group.

faust acknowledges a message whose agent raised and moves past it, so the agent
never raises and never acknowledges itself: it reads with ``stream.noack()`` and
queues each event by topic partition; one task per partition runs the cells through
the :class:`~indexer.runtime.handlers.Processor` in offset order (no two cells of a partition
at once, partitions in parallel) and acknowledges an event only after every handler
succeeded or dead-lettered it. faust commits the highest offset below which every
event was acknowledged, so a crash re-delivers from the first unacknowledged cell.
When a cell cannot be settled (the store is down while dead-lettering) the task
waits and handles it again instead of moving on; when a handler stalls the
partition stops there, unacknowledged.

Each dead letter is recorded in the logstore (the source of truth, see
:mod:`indexer.runtime.deadletters`) and mirrored to the ``<name>.dlq`` topic (key: entry id;
value: the entry as JSON; its scalar fields, traceback included, in headers), with
acks=all, before the cell is acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import shutil
import tempfile
import time
import traceback
import warnings
from collections import deque
from typing import Any, NamedTuple

import faust
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from faust.transport.drivers import aiokafka as faust_aiokafka

from indexer.errors import ConfigurationError, SourceUnavailableError
from indexer.runtime.config import AppConfig
from indexer.runtime.deadletters import DeadLetter
from indexer.runtime.handlers import Processor, tailer_deadletter
from indexer.runtime.metrics import AppMetrics
from indexer.runtime.policy import Failure, fingerprint, qualified_name
from logstore import Cell
from logstore.errors import CellstreamError
from logstore.retry import RetryPolicy, retry_call_async
from tailer.config import KafkaOptions
from tailer.errors import PublishError
from tailer.messages import CONTENT_TYPES, decode_cell
from tailer.publishers.kafka import KafkaPublisher
from tailer.security import PLAINTEXT, KafkaSecurity, diagnose

logger = logging.getLogger(__name__)
TP = tuple[str, int]
_WATCH_INTERVAL = 1.0  # positions for the lag metric
_DRAIN_WATCH_INTERVAL = 0.1  # while drain() waits for the end
FETCH_MAX_WAIT_MS = 100  # measured against 5, 20 and 50 ms (bench/app_kafka_bench.py): the lowest p99
_UNSETTLED = RetryPolicy(initial=0.1, maximum=5.0, deadline=None)  # until it works or the app stops
_POSITIONS_RETRY = RetryPolicy(initial=0.1, maximum=1.0, deadline=30.0)  # aiokafka's retriable errors only
_HEADER_TEXT = 8_000  # characters of one text header (messages, tracebacks) in the DLQ topic


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        # faust passes fetch_max_wait_ms=1500 (no setting). aiokafka leaves a partition whose records are
        # waiting to be consumed out of the next fetch, so once they are consumed the partition waits for
        # the fetch under way, which the broker holds up to fetch_max_wait_ms when the partitions in it are
        # quiet (the tailer's dead-letter topic always is): a second of latency. Set before start(), where
        # aiokafka reads it, exactly as the constructor argument would be.
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> _ConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _commit(self, offsets: Any) -> bool:
        """Every commit (periodic, on rebalance, on stop) first runs the app's checkpoint: handlers that only
        buffered what they acknowledged flush it. If that fails nothing is committed (tried again later)."""
        checkpoint = getattr(self.app, "cellstream_checkpoint", None)
        if checkpoint is not None and not await checkpoint():
            return False
        done: bool = await super()._commit(offsets)
        return done


class _View(NamedTuple):
    """Where the assigned partitions end and what the group committed, as fetched at ``taken``."""

    taken: float
    assigned: frozenset[TP]
    ends: dict[TP, int]
    committed: dict[TP, int]


async def group_positions(brokers: str, app: str, topics: list[str], security: KafkaSecurity = PLAINTEXT,
                          ) -> list[tuple[str, int, int | None, int]]:
    """(topic, partition, committed offset or None, end offset) of every partition of ``topics`` for the
    consumer group of ``app`` in Kafka mode: what ``status`` commands show as lag."""
    probe = AIOKafkaConsumer(bootstrap_servers=brokers, client_id=f"{group_id(app)}.status", enable_auto_commit=False,
                             **security.client_options())
    admin = AIOKafkaAdminClient(bootstrap_servers=brokers, client_id=f"{group_id(app)}.status",
                                **security.client_options())
    try:
        await probe.start()
        await admin.start()
        described = await retry_call_async(lambda: admin.describe_topics(topics), _POSITIONS_RETRY)
        partitions = [TopicPartition(d["topic"], p["partition"]) for d in described if d["error_code"] == 0
                      for p in sorted(d["partitions"], key=lambda p: p["partition"])]
        if not partitions:
            return []
        ends = await retry_call_async(lambda: probe.end_offsets(partitions), _POSITIONS_RETRY)
        # A broker's first group lookup creates __consumer_offsets: "coordinator not available" for a
        # few seconds, which a fresh cluster (or one whose offsets topic moves) says to retry.
        found = await retry_call_async(
            lambda: admin.list_consumer_group_offsets(group_id(app), partitions=partitions), _POSITIONS_RETRY)
    except (KafkaError, OSError) as exc:
        raise await _unavailable(brokers, security, exc) from None
    finally:
        await probe.stop()
        await admin.close()
    out = []
    for tp in partitions:
        meta = found.get(tp)
        committed = meta.offset if meta is not None and meta.offset >= 0 else None
        out.append((tp.topic, tp.partition, committed, ends[tp]))
    return out


async def _unavailable(brokers: str, security: KafkaSecurity, exc: BaseException) -> CellstreamError:
    """The error for a Kafka client that failed to start: the configuration problem behind it when there is
    one (refused credentials, an untrusted certificate), else SourceUnavailableError (retriable)."""
    cause = exc if isinstance(exc, ConfigurationError) else await diagnose(brokers, security)
    return cause or SourceUnavailableError(f"Kafka at {brokers}: {type(exc).__name__}: {exc}")


def faust_credentials(security: KafkaSecurity) -> Any:
    """faust's ``broker_credentials`` for ``security`` (None for plaintext)."""
    context = security.ssl_context()
    if security.sasl_mechanism is not None:
        assert security.sasl_password is not None
        return faust.SASLCredentials(
            username=security.sasl_username, password=security.sasl_password.get_secret_value(),
            mechanism=security.sasl_mechanism, ssl_context=context)
    return faust.SSLCredentials(context) if context is not None else None


def group_id(app: str) -> str:
    """The consumer group (and faust app id) of ``app`` in Kafka mode."""
    return f"app.{app}"


def dlq_topic(app: str) -> str:
    return f"{app}.dlq"


def deadletter_headers(entry: DeadLetter) -> list[tuple[str, bytes]]:
    """The entry's fields as message headers (text); the body and history are in the value only."""
    fields: dict[str, Any] = {
        "app": entry.app, "handler": entry.handler, "id": entry.id, "version": entry.version,
        "status": entry.status, "column": entry.column, "error_type": entry.error_type,
        "message": entry.message, "fingerprint": entry.fingerprint, "attempts": entry.attempts,
        "first_failure": entry.first_failure.isoformat(), "last_failure": entry.last_failure.isoformat(),
        "traceback": entry.traceback,
    }
    fields.update({f"cell_{k}": v for k, v in entry.cell.items()})
    fields.update({f"source_{k}": v for k, v in entry.source.items()})
    headers = [(name, str(value)[:_HEADER_TEXT].encode()) for name, value in fields.items() if value is not None]
    return [*headers, ("content-type", CONTENT_TYPES["json"])]


class KafkaRunner:
    """One process of an app in Kafka mode (see the module docstring); start() and stop() are safe twice."""

    def __init__(self, config: AppConfig, brokers: str, processor: Processor, metrics: AppMetrics) -> None:
        self.config = config
        self.brokers = brokers
        self.processor = processor
        self.metrics = metrics
        self.group = group_id(config.name)
        self.topics = [f"{config.topic_prefix}.{column}" for column in sorted(processor.by_column)]
        self.tailer_deadletters = f"{config.topic_prefix}-deadletter"
        self.dlq_topic = dlq_topic(config.name)
        self.publisher = KafkaPublisher(KafkaOptions(brokers=brokers, client_id=self.group, security=config.kafka))
        self._app: Any = None  # the faust.App, built by start()
        self._datadir: str | None = None
        self._probe: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._queues: dict[TP, deque[Any]] = {}
        self._tasks: dict[TP, asyncio.Task[None]] = {}
        self._queued = 0
        self._room = asyncio.Event()
        self._settled: dict[TP, int] = {}  # next offset after the last acknowledged event
        self._handling: dict[TP, int] = {}  # events at the head of a queue being handled now
        self._view: _View | None = None
        self._assigned_once = False
        self._draining = False
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._state = "new"

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self._state != "new":
            return
        self._state = "starting"
        try:
            await self._start()
        except (KafkaError, OSError, PublishError, ConfigurationError) as exc:
            await self.stop()
            raise await _unavailable(self.brokers, self.config.kafka, exc) from None
        except BaseException:
            await self.stop()
            raise
        self._state = "running"

    async def _start(self) -> None:
        await self.publisher.start()
        await self.publisher.prepare_topic(self.dlq_topic, 1, self.config.replication_factor)
        security = self.config.kafka.client_options()
        self._probe = AIOKafkaConsumer(bootstrap_servers=self.brokers, client_id=f"{self.group}.probe",
                                       enable_auto_commit=False, **security)
        await self._probe.start()
        self._admin = AIOKafkaAdminClient(bootstrap_servers=self.brokers, client_id=f"{self.group}.probe",
                                          **security)
        await self._admin.start()
        self._datadir = tempfile.mkdtemp(prefix=f"cellstream-{self.config.name}-")
        app = faust.App(
            self.group, broker=f"kafka://{self.brokers}", web_enabled=False, datadir=self._datadir,
            autodiscover=False, topic_disable_leader=True, stream_wait_empty=True,
            consumer_auto_offset_reset="earliest" if self.config.start_from == "beginning" else "latest",
            broker_commit_interval=self.config.commit_every(kafka=True),
            broker_session_timeout=self.config.session_timeout,
            broker_credentials=faust_credentials(self.config.kafka),
        )
        app.transport.Consumer = _Consumer  # type: ignore[misc]  # read when faust builds its consumer
        app.cellstream_checkpoint = self._checkpoint  # type: ignore[attr-defined]  # read by _Consumer._commit
        source = app.topic(*self.topics, self.tailer_deadletters, value_serializer="raw", key_serializer="raw")
        app.agent(source, name=f"{self.group}.cells")(self._agent)
        app.on_partitions_assigned.connect(self._on_assigned)
        self._app = app
        self.processor.on_deadletter = self._mirror
        await app.start()  # events may arrive before it returns: they are handled like any other
        self._watcher = asyncio.create_task(self._watch(), name=f"{self.group}-watch")

    async def stop(self) -> None:
        """Finish the cells being handled (up to stop_timeout), abandon the queued ones, commit, close."""
        if self._state in ("stopping", "stopped"):
            return
        self._state = "stopping"
        for tp in list(self._queues):
            self._abandon(tp)
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.config.stop_timeout)
            for task in late:
                logger.warning("%s: a handler did not finish within %ss; its cell will be delivered again",
                               task.get_name(), self.config.stop_timeout)
                task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        if self._app is not None:
            # What is unacknowledged now was abandoned: faust is to commit what was acknowledged and stop,
            # not wait for the rest (it would wait forever). During a rebalance it does wait, so a revoked
            # partition's cells are finished here before another process gets them.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._app.conf.stream_wait_empty = False
        if self.processor.on_deadletter == self._mirror:
            self.processor.on_deadletter = None
        for close in (self._app.stop if self._app is not None else None,
                      self._probe.stop if self._probe is not None else None,
                      self._admin.close if self._admin is not None else None, self.publisher.stop):
            if close is not None:
                try:
                    await close()
                except Exception as exc:  # stopping goes on: what was acknowledged is committed or re-delivered
                    logger.warning("%s: while stopping: %s: %s", self.group, type(exc).__name__, exc)
        if self._datadir is not None:
            shutil.rmtree(self._datadir, ignore_errors=True)
        self._state = "stopped"

    async def _checkpoint(self) -> bool:
        """Flush the buffering handlers before a commit; False skips the commit. A flush that fails for good
        (not retriable) stops the app, as a failed delivery would."""
        try:
            await self.processor.checkpoint()
        except Exception as exc:
            if getattr(exc, "retriable", False):
                logger.warning("%s: commit skipped, a handler could not flush: %s", self.group, exc)
            else:
                logger.error("%s: a handler cannot make acknowledged cells durable (%s); stopping", self.group, exc)
                self._error = exc
            return False
        return True

    @property
    def _stopping(self) -> bool:
        return self._state in ("stopping", "stopped")

    def failed(self) -> BaseException | None:
        if self._error is None and self._app is not None and self._app.crash_reason is not None:
            reason = self._app.crash_reason
            self._error = SourceUnavailableError(f"the faust app stopped: {type(reason).__name__}: {reason}")
        return self._error

    def lost_shards(self) -> frozenset[int]:
        return frozenset()  # a consumer group moves partitions by rebalancing, never by fencing this process

    def caught_up(self, since: float) -> bool:
        """Every partition this process is assigned is handled up to the end it had after ``since``."""
        if not self._draining:
            self._draining = True
            self._wake.set()
        view = self._view
        if view is None or view.taken < since or not self._assigned_once or self._app.rebalancing:
            return False
        if view.assigned != self._assignment() or self._queued:
            return False
        return all(max(self._settled.get(tp, 0), view.committed.get(tp, 0)) >= end for tp, end in view.ends.items())

    # -- the faust side -------------------------------------------------------------
    async def _on_assigned(self, sender: Any, /, *args: Any, **kwargs: Any) -> None:
        self._assigned_once = True

    def _assignment(self) -> frozenset[TP]:
        return frozenset((tp.topic, tp.partition) for tp in self._app.consumer.assignment())

    async def _agent(self, stream: Any) -> None:
        async for event in stream.noack().events():
            if self._stopping:
                continue  # not acknowledged: delivered again after the restart
            while self._queued >= self.config.max_in_flight:
                self._room.clear()
                await self._room.wait()
            message = event.message
            tp = (message.topic, message.partition)
            self._queues.setdefault(tp, deque()).append(event)
            self._queued += 1
            task = self._tasks.get(tp)
            if task is None or task.done():
                self._tasks[tp] = asyncio.create_task(self._work(tp), name=f"handlers-{tp[0]}-{tp[1]}")

    def _abandon(self, tp: TP) -> None:
        queue = self._queues.get(tp)
        if not queue:
            return
        task = self._tasks.get(tp)
        keep = self._handling.get(tp, 0) if task is not None and not task.done() else 0  # those finish
        self._queued -= len(queue) - keep
        while len(queue) > keep:
            queue.pop()
        self._room.set()

    async def _work(self, tp: TP) -> None:
        queue = self._queues[tp]
        try:
            while queue and self.processor.stalled is None:
                # Consecutive events are handled together (an index applies them in one transaction); the
                # batch stays at the head of the queue, so stop() abandons only what comes after it.
                batch = list(itertools.islice(queue, self.config.page_size))
                self._handling[tp] = len(batch)
                try:
                    settled = await self._settle(batch)
                finally:
                    self._handling[tp] = 0
                if not settled:
                    return  # stalled: the events stay unacknowledged; the app stops
                for event in batch:
                    queue.popleft()
                    event.ack()
                self._queued -= len(batch)
                self._room.set()
                self._settled[tp] = batch[-1].message.offset + 1
        except Exception as exc:  # a bug of the runtime: stop the app rather than skip or reorder cells
            logger.exception("%s partition %s: cannot go on", self.group, tp)
            self._error = exc

    async def _settle(self, batch: list[Any]) -> bool:
        """Run the handlers on the events until they succeed or dead-letter them; False when one stalled."""
        delays = _UNSETTLED.delays()
        while True:
            try:
                return await self._handle(batch)
            except Exception as exc:
                if self._stopping:
                    raise asyncio.CancelledError from None  # abandon them, unacknowledged
                if not getattr(exc, "retriable", False):
                    raise  # not a passing outage: the runner fails rather than retry a bug forever
                delay = next(delays)
                m = batch[0].message
                logger.warning("%s/%d@%d+%d not settled (%s: %s); handling them again in %.1fs", m.topic,
                               m.partition, m.offset, len(batch), type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)

    async def _handle(self, batch: list[Any]) -> bool:
        """Runs of decodable cells go to the processor together; anything else is dead-lettered in its place."""
        cells: list[tuple[Cell, dict[str, Any]]] = []
        for event in batch:
            m = event.message
            source = {"mode": "kafka", "topic": m.topic, "partition": m.partition, "offset": m.offset}
            cell, where, failure = self._decode(m)
            if cell is not None:
                cells.append((cell, source))
                continue
            if cells and not await self.processor.process_many(cells):
                return False
            cells = []
            assert failure is not None
            if not await self._undecodable(where, source, failure):
                return False
        return not cells or await self.processor.process_many(cells)

    def _decode(self, m: Any) -> tuple[Cell | None, dict[str, Any], Failure | None]:
        where = {name: value.decode(errors="replace") for name, value in m.headers or ()
                 if name in ("shard", "added_id", "column", "ref_key", "created_at")}
        where["row_key"] = (m.key or b"").decode(errors="replace")
        try:
            if m.topic == self.tailer_deadletters:  # a cell the tailer gave up on: no attempt, straight to the DLQ
                record = json.loads(m.value)
                if not isinstance(record, dict):
                    raise ValueError(f"not a tailer dead-letter record: {type(record).__name__}")
                where, failure = tailer_deadletter(record)
                return None, where, failure
            return decode_cell(m.value, m.headers), where, None
        except Exception as exc:  # anything a foreign producer wrote: dead-letter it, never skip it
            text = "".join(traceback.format_exception(exc))
            failure = Failure(qualified_name(type(exc)), f"undecodable message: {exc}", text, fingerprint(exc), False)
            if m.topic != self.tailer_deadletters:
                where["column"] = m.topic[len(self.config.topic_prefix) + 1:]
            return None, where, failure

    async def _undecodable(self, where: dict[str, Any], source: dict[str, Any], failure: Failure) -> bool:
        """Dead-letter for the handlers of the cell's column; for all of them when the column is unknown."""
        if where.get("column"):
            return await self.processor.undecodable(where, source, failure)
        for column in self.processor.by_column:
            if not await self.processor.undecodable({**where, "column": column}, source, failure):
                return False
        return True

    async def _mirror(self, entry: DeadLetter) -> None:
        """Send the entry to the DLQ topic and wait for acks=all; retried until it is taken or the app stops.
        If the broker refuses it as too large, the body and history are left out (the store has them)."""
        value = entry.model_dump_json().encode()
        headers = deadletter_headers(entry)
        delays = _UNSETTLED.delays()
        while True:
            try:
                future = await self.publisher.send(self.dlq_topic, 0, entry.id.encode(), value, headers)
                await future
                return
            except PublishError as exc:
                if self._stopping:
                    raise
                if not exc.retriable:
                    smaller = entry.model_copy(update={"body": None, "history": [], "traceback": ""})
                    smaller_value = smaller.model_dump_json().encode()
                    if smaller_value == value:
                        raise
                    value = smaller_value
                    headers = [*deadletter_headers(smaller), ("omitted", b"body,history,traceback")]
                    logger.warning("dead letter %s is too large for %s; mirrored without its body", entry.id,
                                   self.dlq_topic)
                    continue
                delay = next(delays)
                logger.warning("dead letter %s not mirrored to %s (%s); again in %.1fs", entry.id, self.dlq_topic,
                               exc, delay)
                await asyncio.sleep(delay)

    # -- positions, for drain and the lag metric ----------------------------------------
    async def _watch(self) -> None:
        assert self._probe is not None and self._admin is not None
        while True:
            taken = time.monotonic()
            try:
                assigned = self._assignment()
                partitions = [TopicPartition(*tp) for tp in sorted(assigned)]
                ends: dict[TP, int] = {}
                committed: dict[TP, int] = {}
                if partitions:
                    found = await self._probe.end_offsets(partitions)
                    ends = {(tp.topic, tp.partition): offset for tp, offset in found.items()}
                    offsets = await self._admin.list_consumer_group_offsets(self.group, partitions=partitions)
                    committed = {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()
                                 if meta is not None and meta.offset >= 0}
                self._view = _View(taken, assigned, ends, committed)
                for (topic, partition), end in ends.items():
                    done = max(self._settled.get((topic, partition), 0), committed.get((topic, partition), 0))
                    self.metrics.lag.labels(self.config.name, topic, str(partition)).set(max(0, end - done))
            except (KafkaError, OSError) as exc:
                logger.debug("%s: positions not read (%s: %s)", self.group, type(exc).__name__, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _DRAIN_WATCH_INTERVAL if self._draining else _WATCH_INTERVAL)
            self._wake.clear()

    async def __aenter__(self) -> KafkaRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

