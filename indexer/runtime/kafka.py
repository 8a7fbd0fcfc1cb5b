"""Kafka mode: the app consumes the tailer's topics as the consumer group ``app.<name>``, directly.

The group member is librdkafka's consumer (:mod:`indexer.runtime.group_consumer`); the app's DLQ producer and
its position probes are aiokafka's, as the tailer's are. It subscribes by pattern to ``<prefix>.<column>`` for
every column with a handler and to ``<prefix>-deadletter`` (so it never makes a broker create a topic). Each
partition's records are handled in offset order by one task (partitions in parallel); a record is *settled* once
every handler succeeded or dead-lettered it, and no offset is committed past an unsettled record, nor before the
handlers that buffer have flushed. A revoked partition is committed at its settled offset before it is handed
over. Each dead letter is recorded in the store (:mod:`indexer.runtime.dlq_store`) and mirrored to the
``<name>.dlq`` topic before its cell is settled.
docs/indexer.md (Kafka mode) gives the design.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, cast

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from confluent_kafka import Message

from indexer.errors import CommitRefusedError, ConfigurationError, SourceUnavailableError
from indexer.runtime.config import AppConfig
from indexer.runtime.dlq_store import DeadLetter
from indexer.runtime.group_consumer import GroupConsumer, subscription_pattern
from indexer.runtime.handlers import Processor, tailer_deadletter
from indexer.runtime.metrics import AppMetrics
from indexer.runtime.policy import Failure, fingerprint, qualified_name
from logstore import Cell
from logstore.errors import CellstreamError
from logstore.retry import RetryPolicy, retry_call_async
from tailer.config import KafkaOptions
from tailer.errors import PublishError
from tailer.messages import CONTENT_TYPES, decode_cell_value
from tailer.publishers.kafka import KafkaPublisher
from tailer.security import PLAINTEXT, KafkaSecurity, diagnose

logger = logging.getLogger(__name__)
TP = tuple[str, int]
_WATCH_INTERVAL = 5.0  # positions for the lag metric (as often as an index version's lag)
_DRAIN_WATCH_INTERVAL = 0.1  # while drain() waits for the end
_MISSING_TOPICS_INTERVAL = 30.0  # between looks for subscribed topics not there yet (a log line; librdkafka subscribes)
_METADATA_MAX_AGE_MS = 3000
# librdkafka's prefetch: enough to keep a fast handler busy, far below its default of 64 MB (peak RSS).
_QUEUED_KBYTES = 8192
_FETCH_BACKOFF_MS = 5
_FETCH_MIN_BYTES = 64 << 10
_UNSETTLED = RetryPolicy(initial=0.1, maximum=5.0, deadline=None)  # until it works or the app stops
_POSITIONS_RETRY = RetryPolicy(initial=0.1, maximum=1.0, deadline=30.0)  # aiokafka's retriable errors only
_HEADER_TEXT = 8_000  # characters of one text header (messages, tracebacks) in the DLQ topic


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
        # Every topic, not the ones asked for: naming a missing one would make the broker create it.
        described = await retry_call_async(admin.describe_topics, _POSITIONS_RETRY)
        order = {topic: n for n, topic in enumerate(topics)}
        partitions = [TopicPartition(d["topic"], p["partition"])
                      for d in sorted(described, key=lambda d: order.get(d["topic"], -1))
                      if d["error_code"] == 0 and d["topic"] in order
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


def fetch_settings(wait: float) -> dict[str, int]:
    """librdkafka's fetch settings for ``AppConfig.fetch_wait``: a broker holds a fetch until 64 KiB of records or
    ``wait`` seconds, so that records arriving a few at a time reach the app a handful at once (one wake-up of the
    loop for each), rather than a fetch, a poll and a hand-over for every one or two of them. Once records are
    waiting (a drain, a backlog) every fetch is full at once and nothing waits."""
    if wait == 0:
        return {"fetch.min.bytes": 1}
    return {"fetch.min.bytes": _FETCH_MIN_BYTES, "fetch.wait.max.ms": max(1, round(wait * 1000))}


def group_id(app: str) -> str:
    """The consumer group of ``app`` in Kafka mode."""
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


async def mirror_deadletter(publisher: KafkaPublisher, topic: str, entry: DeadLetter,
                            stopping: Callable[[], bool] = lambda: False) -> None:
    """Send the entry to the DLQ ``topic`` and wait for acks=all; retried until it is taken or ``stopping()``.
    If the broker refuses it as too large, the body and history are left out (the store has them)."""
    value = entry.model_dump_json().encode()
    headers = deadletter_headers(entry)
    delays = _UNSETTLED.delays()
    while True:
        try:
            future = await publisher.send(topic, 0, entry.id.encode(), value, headers)
            await future
            return
        except PublishError as exc:
            if stopping():
                raise
            if not exc.retriable:
                smaller = entry.model_copy(update={"body": None, "history": [], "traceback": ""})
                smaller_value = smaller.model_dump_json().encode()
                if smaller_value == value:
                    raise
                value = smaller_value
                headers = [*deadletter_headers(smaller), ("omitted", b"body,history,traceback")]
                logger.warning("dead letter %s is too large for %s; mirrored without its body", entry.id, topic)
                continue
            delay = next(delays)
            logger.warning("dead letter %s not mirrored to %s (%s); again in %.1fs", entry.id, topic, exc, delay)
            await asyncio.sleep(delay)


def _headers(m: Message) -> list[tuple[str, bytes]]:
    """A record's headers as the tailer writes them: (name, bytes); a header without a value is left out."""
    headers = cast(list[tuple[str, Any]], m.headers() or [])  # a consumer's records: a list, never a dict
    return [(name, value) for name, value in headers if isinstance(value, bytes)]


class _Partition:
    """One assigned partition: its fetched records not yet settled, and how far it is settled and committed."""

    def __init__(self) -> None:
        self.queue: deque[Message] = deque()
        self.task: asyncio.Task[None] | None = None
        self.handling = 0  # records at the head of the queue being handled now
        self.settled = -1  # the offset after the last settled record (-1: none yet)
        self.committed = -1  # the last offset this process committed
        self.paused = False


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
        self._consumer: GroupConsumer | None = None
        self._probe: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._committer: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._parts: dict[TP, _Partition] = {}
        self._commit_lock = asyncio.Lock()
        self._view: _View | None = None
        self._assigned_once = False
        self._waiting: set[str] = set()  # subscribed topics that do not exist yet, each logged once
        self._found: set[str] = set()  # subscribed topics seen to exist
        self._topics_looked = float("-inf")  # when the missing topics were last looked for
        self._rebalancing = False
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
        session_ms = int(self.config.session_timeout * 1000)
        config = {
            "bootstrap.servers": self.brokers, "group.id": self.group, "client.id": self.group,
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest" if self.config.start_from == "beginning" else "latest",
            "session.timeout.ms": session_ms, "heartbeat.interval.ms": max(1000, session_ms // 3),
            "max.partition.fetch.bytes": 1 << 20, "queued.max.messages.kbytes": _QUEUED_KBYTES,
            # Once the prefetch is full, fetch again as soon as it has room (librdkafka's default waits a second).
            "fetch.queue.backoff.ms": _FETCH_BACKOFF_MS,
            **fetch_settings(self.config.fetch_wait),
            # The tailer creates its topics after an app may have subscribed: see them within seconds, not the
            # default five minutes.
            "topic.metadata.refresh.interval.ms": _METADATA_MAX_AGE_MS,
            **self.config.kafka.librdkafka_config(),
        }

        # By pattern, so that no subscribed topic is ever auto-created by the subscription.
        self._consumer = GroupConsumer(
            config, subscription_pattern([*self.topics, self.tailer_deadletters]), on_messages=self._received,
            on_assigned=self._assigned, on_revoked=self._revoked, on_lost=self._lost, on_error=self._failed)
        self.processor.on_deadletter = self._mirror
        await self._consumer.start()
        self._committer = asyncio.create_task(self._commit_every(), name=f"{self.group}-commit")
        self._watcher = asyncio.create_task(self._watch(), name=f"{self.group}-watch")

    async def stop(self) -> None:
        """Finish the cells being handled (up to stop_timeout), abandon the queued ones, commit, close."""
        if self._state in ("stopping", "stopped"):
            return
        self._state = "stopping"
        for task in (self._committer, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._consumer is not None:  # nothing more is handed to _received
            await self._consumer.halt()
        await self._finish(set(self._parts))
        with contextlib.suppress(Exception):
            await self._commit(set(self._parts))
        if self.processor.on_deadletter == self._mirror:
            self.processor.on_deadletter = None
        for close in (self._consumer.close if self._consumer is not None else None,
                      self._probe.stop if self._probe is not None else None,
                      self._admin.close if self._admin is not None else None, self.publisher.stop):
            if close is not None:
                try:
                    await close()
                except Exception as exc:  # stopping goes on: what was settled is committed or re-delivered
                    logger.warning("%s: while stopping: %s: %s", self.group, type(exc).__name__, exc)
        self._state = "stopped"

    async def _finish(self, tps: set[TP]) -> None:
        """Drop the queued records of ``tps`` and wait (up to stop_timeout) for the pages being handled."""
        tasks = []
        for tp in tps:
            part = self._parts.get(tp)
            if part is None:
                continue
            self._abandon(part)
            if part.task is not None and not part.task.done():
                tasks.append(part.task)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.config.stop_timeout)
            for task in late:
                logger.warning("%s: a handler did not finish within %ss; its cell will be delivered again",
                               task.get_name(), self.config.stop_timeout)
                task.cancel()

    @property
    def _stopping(self) -> bool:
        return self._state in ("stopping", "stopped")

    def failed(self) -> BaseException | None:
        return self._error

    def lost_shards(self) -> frozenset[int]:
        return frozenset()  # a consumer group moves partitions by rebalancing, never by fencing this process

    def caught_up(self, since: float) -> bool:
        """Every partition this process is assigned is handled up to the end it had after ``since``."""
        if not self._draining:
            self._draining = True
            self._wake.set()
        view = self._view
        if view is None or view.taken < since or not self._assigned_once or self._rebalancing:
            return False
        if view.assigned != self._assignment() or any(p.queue for p in self._parts.values()):
            return False
        return all(max(self._parts[tp].settled if tp in self._parts else 0, view.committed.get(tp, 0)) >= end
                   for tp, end in view.ends.items())

    # -- the consumer group ---------------------------------------------------------
    def _assignment(self) -> frozenset[TP]:
        return frozenset(self._parts)

    def _assigned(self, tps: set[TP]) -> None:
        for tp in tps:
            self._parts.setdefault(tp, _Partition())
        self._assigned_once = True
        self._rebalancing = False

    async def _revoked(self, tps: set[TP]) -> None:
        """Before another process may take them: finish the pages under way, commit, forget the rest."""
        self._rebalancing = True
        mine = tps & set(self._parts)
        await self._finish(mine)
        try:
            await self._commit(mine)
        except Exception as exc:  # the new owner starts from the last commit: re-delivery, never a gap
            logger.warning("%s: offsets of revoked partitions not committed (%s: %s)", self.group,
                           type(exc).__name__, exc)
        for tp in mine:
            del self._parts[tp]

    def _lost(self, tps: set[TP]) -> None:
        """The group gave the partitions away without a revocation (this member's session expired): nothing
        can be committed for them; their new owner starts from the last commit, so handled cells come again."""
        for tp in tps & set(self._parts):
            part = self._parts.pop(tp)
            self._abandon(part)
        logger.warning("%s: lost %d partitions (session expired); they are delivered again from the last commit",
                       self.group, len(tps))

    def _failed(self, exc: BaseException) -> None:
        """The consumer cannot go on (a fatal client error)."""
        logger.error("%s: consuming stopped: %s: %s", self.group, type(exc).__name__, exc)
        self._error = SourceUnavailableError(f"Kafka consumer of {self.group}: {type(exc).__name__}: {exc}")

    def _received(self, records: list[Message]) -> None:
        """A batch from the consumer: each record goes to its partition's queue (offset order), whose task
        handles it."""
        if self._stopping:
            return  # never handed to a handler, never committed: delivered again
        parts, touched = self._parts, {}
        for m in records:
            tp = cast(TP, (m.topic(), m.partition()))  # set on every record (errors never get here)
            part = parts.get(tp)
            if part is not None:  # None: revoked after the fetch; its new owner reads it
                part.queue.append(m)
                touched[tp] = part
        for tp, part in touched.items():
            self._started(tp, part)

    def _started(self, tp: TP, part: _Partition) -> None:
        if part.task is None or part.task.done():
            part.task = asyncio.create_task(self._work(tp, part), name=f"handlers-{tp[0]}-{tp[1]}")
        self._flow(tp, part)

    def _flow(self, tp: TP, part: _Partition) -> None:
        """Back-pressure. librdkafka drops what it prefetched of a partition when the partition is paused, and
        fetches it again on resume, so a partition is paused only once the process holds ``max_in_flight``
        records and it holds more than its share; it is resumed once worked down to half its share, or once
        the process holds half of ``max_in_flight``. The process holds at most about twice that."""
        if self._consumer is None:
            return
        limit = self.config.max_in_flight
        share = max(self.config.page_size, limit // max(1, len(self._parts)))
        queued = len(part.queue)
        if not part.paused:
            if queued >= share and self._queued() >= limit:
                self._consumer.pause(tp)
                part.paused = True
        elif queued < share // 2 or self._queued() < limit // 2:
            self._consumer.resume(tp)
            part.paused = False

    def _queued(self) -> int:
        return sum(len(part.queue) for part in self._parts.values())

    def _abandon(self, part: _Partition) -> None:
        keep = part.handling if part.task is not None and not part.task.done() else 0  # those finish
        while len(part.queue) > keep:
            part.queue.pop()

    async def _work(self, tp: TP, part: _Partition) -> None:
        queue = part.queue
        try:
            while queue and self.processor.stalled is None:
                # Consecutive records are handled together (an index applies them in one transaction); the
                # page stays at the head of the queue, so stop() and revocation abandon only what comes after it.
                batch = list(itertools.islice(queue, self.config.page_size))
                part.handling = len(batch)
                try:
                    settled = await self._settle(tp, batch)
                finally:
                    part.handling = 0
                if not settled:
                    return  # stalled: the records stay unsettled; the app stops
                for _ in batch:
                    queue.popleft()
                part.settled = cast(int, batch[-1].offset()) + 1
                if part.paused:
                    self._flow(tp, part)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of the runtime: stop the app rather than skip or reorder cells
            logger.exception("%s partition %s: cannot go on", self.group, tp)
            self._error = exc

    # -- commits --------------------------------------------------------------------
    async def _commit_every(self) -> None:
        while True:
            await asyncio.sleep(self.config.commit_every(kafka=True))
            try:
                await self._commit(set(self._parts))
            except Exception as exc:
                logger.warning("%s: commit failed (%s: %s); tried again in %ss", self.group, type(exc).__name__,
                               exc, self.config.commit_every(kafka=True))

    async def _commit(self, tps: set[TP]) -> None:
        """Note the settled offsets of ``tps``, flush the buffering handlers, commit the noted offsets."""
        async with self._commit_lock:
            noted = {tp: self._parts[tp].settled for tp in tps
                     if tp in self._parts and self._parts[tp].settled > self._parts[tp].committed}
            if not noted or self._consumer is None or not await self._checkpoint():
                return
            try:
                await self._consumer.commit(noted)
            except CommitRefusedError as exc:  # a rebalance took them: their revocation commits
                logger.info("%s: commit refused during a rebalance (%s)", self.group, exc)
                return
            for tp, offset in noted.items():
                if tp in self._parts:
                    self._parts[tp].committed = offset

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

    async def _settle(self, tp: TP, batch: list[Message]) -> bool:
        """Run the handlers on the events until they succeed or dead-letter them; False when one stalled."""
        delays = _UNSETTLED.delays()
        while True:
            try:
                return await self._handle(tp, batch)
            except Exception as exc:
                if self._stopping:
                    raise asyncio.CancelledError from None  # abandon them, unacknowledged
                if not getattr(exc, "retriable", False):
                    raise  # not a passing outage: the runner fails rather than retry a bug forever
                delay = next(delays)
                m = batch[0]
                logger.warning("%s/%d@%d+%d not settled (%s: %s); handling them again in %.1fs", tp[0], tp[1],
                               m.offset(), len(batch), type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)

    async def _handle(self, tp: TP, batch: list[Message]) -> bool:
        """Runs of decodable cells go to the processor together; anything else is dead-lettered in its place."""
        cells: list[tuple[Cell, dict[str, Any]]] = []
        topic, partition = tp
        for m in batch:
            source = {"mode": "kafka", "topic": topic, "partition": partition, "offset": m.offset()}
            cell, where, failure = self._decode(topic, m)
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

    def _decode(self, topic: str, m: Message) -> tuple[Cell | None, dict[str, Any], Failure | None]:
        try:
            if topic == self.tailer_deadletters:  # a cell the tailer gave up on: no attempt, straight to the DLQ
                record = json.loads(m.value())  # type: ignore[arg-type]  # None: undecodable, dead-lettered
                if not isinstance(record, dict):
                    raise ValueError(f"not a tailer dead-letter record: {type(record).__name__}")
                where, failure = tailer_deadletter(record)
                return None, where, failure
            return decode_cell_value(m.value()), {}, None  # type: ignore[arg-type]  # as above
        except Exception as exc:  # anything a foreign producer wrote: dead-letter it, never skip it
            text = "".join(traceback.format_exception(exc))
            failure = Failure(qualified_name(type(exc)), f"undecodable message: {exc}", text, fingerprint(exc), False)
            where = {name: value.decode(errors="replace") for name, value in _headers(m)
                     if name in ("shard", "added_id", "column", "ref_key", "created_at")}
            where["row_key"] = (m.key() or b"").decode(errors="replace")
            if topic != self.tailer_deadletters:
                where["column"] = topic[len(self.config.topic_prefix) + 1:]
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
        await mirror_deadletter(self.publisher, self.dlq_topic, entry, lambda: self._stopping)

    async def _note_missing_topics(self) -> None:
        """Log once each subscribed topic that does not exist yet, and once more when it appears (a metadata
        request for every topic, which names none, every ``_MISSING_TOPICS_INTERVAL`` while one is missing: the
        tailer's dead-letter topic may never exist, and the answer names every topic of the cluster)."""
        subscribed = {*self.topics, self.tailer_deadletters}
        now = time.monotonic()
        if self._probe is None or self._found >= subscribed or now - self._topics_looked < _MISSING_TOPICS_INTERVAL:
            return
        self._topics_looked = now
        found = await self._probe.topics()
        for topic in sorted(subscribed):
            if topic not in found and topic not in self._waiting:
                self._waiting.add(topic)
                logger.info("%s: topic %s does not exist yet; waiting for the tailer to create it (as it publishes "
                            "the column's first cell)", self.group, topic)
            elif topic in found:
                self._found.add(topic)
                if topic in self._waiting:
                    self._waiting.discard(topic)
                    logger.info("%s: topic %s exists now; consuming it", self.group, topic)

    # -- positions, for drain and the lag metric ----------------------------------------
    async def _watch(self) -> None:
        assert self._probe is not None and self._admin is not None
        while True:
            taken = time.monotonic()
            try:
                await self._note_missing_topics()
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
                    part = self._parts.get((topic, partition))
                    done = max(part.settled if part is not None else 0, committed.get((topic, partition), 0))
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

