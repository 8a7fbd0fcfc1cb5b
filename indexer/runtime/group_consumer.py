"""A consumer-group member for an asyncio app: librdkafka's consumer (confluent-kafka), polled by a thread.

librdkafka fetches, decompresses and parses record batches in its own C threads, off the GIL; aiokafka does
that work in the event loop's thread, a fetch round trip at a time, which is most of what an idle app spends
(docs/benchmarks.md, Kafka mode against Quix Streams).

One thread polls, and it alone calls the consumer: confluent-kafka serializes the calls on a handle, so a call
from another thread would wait for a poll to end, and may wait for ever. Pauses, resumes and commits are queued
to it and run between polls (once it has stopped, in a worker thread). It takes whatever librdkafka has fetched
(a batch per poll, ``consume(n, 0)`` after the first message, so a lone message is not held back to fill a
batch) and hands each batch to the loop with ``call_soon_threadsafe``. Rebalances reach the loop through the
same queue, in librdkafka's order: an assignment is known before the first message of it; a revocation blocks
the polling thread (and so the rebalance) until the loop has settled and committed what it handled of the
revoked partitions. At most ``MAX_HANDED`` batches are on their way to the loop at once, so a slow loop pauses
polling rather than let memory grow; librdkafka's own prefetch is bounded by ``queued.max.messages.kbytes``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from indexer.errors import CommitRefusedError

logger = logging.getLogger(__name__)
TP = tuple[str, int]
POLL_SECONDS = 0.05  # the longest wait of a queued pause, resume or commit, and of stop()
_WAIT = 0.01  # between looks at the queued calls while the polling thread waits for the loop
BATCH = 2000  # messages taken from librdkafka per hand-over at most
MAX_HANDED = 4  # batches handed to the loop and not yet taken
# Commit errors that mean "a rebalance took the partitions": their revocation (or new owner) commits.
REBALANCING = frozenset({KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
                         KafkaError.UNKNOWN_MEMBER_ID, KafkaError._NO_OFFSET})


def subscription_pattern(topics: list[str]) -> str:
    """librdkafka's pattern subscription (a leading ``^``) matching exactly ``topics``. Only ``.`` needs an
    escape in a topic name ([A-Za-z0-9._-]), and librdkafka's regex engine knows no other escapes."""
    return "^(" + "|".join(topic.replace(".", "\\.") for topic in sorted(topics)) + ")$"


class GroupConsumer:
    """A member of a consumer group whose messages and rebalances are handled on one asyncio loop.

    Args:
        config: librdkafka properties (``bootstrap.servers``, ``group.id``, security...).
        pattern: the subscription (:func:`subscription_pattern`).
        on_messages: called on the loop with each batch, in the order fetched (per partition: offset order).
        on_assigned: called on the loop with the partitions of a new assignment, before any of their messages.
        on_revoked: awaited on the loop with partitions being revoked; the rebalance waits for it.
        on_lost: called on the loop with partitions lost without a revocation (the session expired).
        on_error: called on the loop with an error the consumer cannot go on after.
    """

    def __init__(self, config: dict[str, Any], pattern: str, *, on_messages: Callable[[list[Message]], None],
                 on_assigned: Callable[[set[TP]], None], on_revoked: Callable[[set[TP]], Awaitable[None]],
                 on_lost: Callable[[set[TP]], None], on_error: Callable[[BaseException], None]) -> None:
        self._config = {**config, "logger": logger, "error_cb": self._on_client_error}
        self._pattern = pattern
        self._on_messages = on_messages
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._on_lost = on_lost
        self._on_error = on_error
        self._consumer: Consumer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._handed = threading.BoundedSemaphore(MAX_HANDED)
        self._closing = False
        self._calls: queue.SimpleQueue[tuple[Callable[[Consumer], Any], concurrent.futures.Future[Any]]] = \
            queue.SimpleQueue()
        self._polling = False  # calls go to the polling thread while True, else to a worker thread
        self._calls_lock = threading.Lock()

    async def start(self) -> None:
        """Join the group (in the background: the assignment arrives through ``on_assigned``)."""
        self._loop = asyncio.get_running_loop()
        self._consumer = Consumer(self._config)
        self._consumer.subscribe([self._pattern], on_assign=self._assign, on_revoke=self._revoke,
                                 on_lost=self._lose)
        self._thread = threading.Thread(target=self._poll, name=f"{self._config['group.id']}-poll", daemon=True)
        self._polling = True
        self._thread.start()

    async def halt(self) -> None:
        """Stop polling: once this returns, no batch is handed to the loop any more (commits still work)."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def close(self) -> None:
        """Stop polling and leave the group. The caller has committed what it settled: the revocation that
        leaving makes is not handed to the loop."""
        await self.halt()
        if self._consumer is not None:
            self._closing = True
            consumer, self._consumer = self._consumer, None
            await asyncio.to_thread(consumer.close)

    def pause(self, tp: TP) -> None:
        """Stop fetching ``tp`` (soon: between two polls). librdkafka drops what it prefetched of it and fetches
        that again on resume; what was handed to the loop already stays handed. Nothing once polling stopped."""
        if not self._stop.is_set():
            self._call(lambda consumer: consumer.pause([TopicPartition(*tp)])).add_done_callback(self._failed)

    def resume(self, tp: TP) -> None:
        if not self._stop.is_set():
            self._call(lambda consumer: consumer.resume([TopicPartition(*tp)])).add_done_callback(self._failed)

    def _failed(self, future: concurrent.futures.Future[Any]) -> None:
        """A pause or resume that failed (a partition revoked meanwhile): said, as nothing waits for it."""
        if future.exception() is not None:
            logger.info("%s: %s", self._config["group.id"], future.exception())

    def _call(self, call: Callable[[Consumer], Any]) -> concurrent.futures.Future[Any]:
        """Run ``call`` on the consumer in the polling thread, or in a worker thread once polling stopped."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._calls_lock:
            if self._polling:
                self._calls.put((call, future))
                return future
        consumer = self._consumer
        if consumer is None:
            future.set_exception(KafkaException(KafkaError(KafkaError._STATE, "the consumer is closed")))
        else:
            threading.Thread(target=self._run, args=(consumer, call, future), daemon=True).start()
        return future

    @staticmethod
    def _run(consumer: Consumer, call: Callable[[Consumer], Any], future: concurrent.futures.Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return  # its waiter gave up (a commit cancelled by stop()): setting a result would raise in this thread
        try:
            future.set_result(call(consumer))
        except BaseException as exc:
            future.set_exception(exc)

    def _run_calls(self, consumer: Consumer) -> None:
        while not self._calls.empty():
            try:
                call, future = self._calls.get_nowait()
            except queue.Empty:
                return
            self._run(consumer, call, future)

    async def commit(self, offsets: dict[TP, int]) -> None:
        """Commit ``offsets`` (the next offset to read, per partition) and wait for the broker.

        Raises:
            CommitRefusedError: the member is rebalancing or no longer in the group.
            KafkaException: any other failure (retried by the next commit).
        """
        if self._consumer is None or not offsets:
            return
        partitions = [TopicPartition(topic, partition, offset) for (topic, partition), offset in offsets.items()]
        try:
            done = await asyncio.wrap_future(
                self._call(lambda consumer: consumer.commit(offsets=partitions, asynchronous=False)))
        except KafkaException as exc:
            error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if error is not None and error.code() in REBALANCING:
                raise CommitRefusedError(error.str()) from None
            raise
        for tp in done or ():
            if tp.error is not None:
                if tp.error.code() in REBALANCING:
                    raise CommitRefusedError(tp.error.str())
                raise KafkaException(tp.error)

    # -- the polling thread ------------------------------------------------------------
    def _poll(self) -> None:
        assert self._consumer is not None and self._loop is not None
        consumer, loop = self._consumer, self._loop
        try:
            while not self._stop.is_set():
                self._run_calls(consumer)
                first = consumer.poll(POLL_SECONDS)
                if first is None:
                    continue
                records = []
                for m in (first, *consumer.consume(BATCH - 1, 0)):
                    error = m.error()
                    if error is None:
                        records.append(m)
                    else:
                        self._message_error(error)
                if not records:
                    continue
                while not (self._handed.acquire(blocking=False) or self._handed.acquire(timeout=_WAIT)):
                    self._run_calls(consumer)
                    if self._stop.is_set():
                        return  # not handed: never acknowledged, so fetched again by whoever owns them next
                loop.call_soon_threadsafe(self._hand, records)
        except Exception as exc:  # a fatal client error, or the loop closed under the thread
            if not self._stop.is_set():
                self._to_loop(self._on_error, exc)
        finally:
            with self._calls_lock:  # what comes from now on runs in a worker thread
                self._polling = False
            self._run_calls(consumer)

    def _hand(self, records: list[Message]) -> None:
        self._handed.release()
        if not self._stop.is_set():  # after halt() none: they were never acknowledged, so they come again
            self._on_messages(records)

    def _message_error(self, error: KafkaError) -> None:
        if error.fatal():
            raise KafkaException(error)
        logger.warning("%s: %s", self._config["group.id"], error.str())

    def _on_client_error(self, error: KafkaError) -> None:
        """librdkafka's errors outside messages: brokers down or back (it reconnects), or fatal ones."""
        if error.fatal():
            self._to_loop(self._on_error, KafkaException(error))
        elif error.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            logger.info("%s: %s (reconnecting)", self._config["group.id"], error.str())
        else:
            logger.warning("%s: %s", self._config["group.id"], error.str())

    def _to_loop(self, callback: Callable[[Any], None], argument: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(callback, argument)

    # -- rebalances (on the thread that polls, or closes) ------------------------------------
    def _assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._to_loop(self._on_assigned, {(tp.topic, tp.partition) for tp in partitions})

    def _revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        loop = self._loop
        if self._closing or loop is None or loop.is_closed():
            return
        tps = {(tp.topic, tp.partition) for tp in partitions}
        done = asyncio.run_coroutine_threadsafe(self._revoked(tps), loop)
        while True:  # the rebalance waits for it (and runs its commit), unless the loop goes away meanwhile
            try:
                done.result(timeout=_WAIT)
                return
            except concurrent.futures.TimeoutError:
                if loop.is_closed():
                    return
                self._run_calls(_consumer)
            except Exception as exc:
                logger.warning("%s: revocation of %s failed (%s: %s)", self._config["group.id"], sorted(tps),
                               type(exc).__name__, exc)
                return

    async def _revoked(self, tps: set[TP]) -> None:
        await self._on_revoked(tps)

    def _lose(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._to_loop(self._on_lost, {(tp.topic, tp.partition) for tp in partitions})
