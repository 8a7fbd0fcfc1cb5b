"""faust-streaming apps on cellstream's topics: :func:`register_codec` decodes a tailer message into a
:class:`logstore.Cell`, :class:`DeadLetters` gives a faust agent cellstream's dead-lettering (an entry like an
:class:`~indexer.App` of the same name writes, mirrored to ``<app>.dlq`` before it returns), and
:func:`tailer_deadletter` reads a record of the tailer's dead-letter topic.

    register_codec()                                      # the "cellstream" value serializer
    cells = app.topic("cells.BASE", value_serializer="cellstream")
    dead = DeadLetters("rides", store="mysql://...", brokers="localhost:9092")
    ...
            await dead.deadletter("bill", event, exc)     # then acknowledge the event

docs/indexer.md (faust apps on cellstream topics) has the whole example.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import traceback
from typing import Any

import faust
from faust.serializers import codecs

import logstore
from indexer.runtime.dlq_store import DeadLetter, DeadLetterStore
from indexer.runtime.handlers import tailer_deadletter as _tailer_deadletter
from indexer.runtime.kafka import dlq_topic, mirror_deadletter
from indexer.runtime.policy import Failure, Outcome, fingerprint, is_retriable, qualified_name
from logstore import Cell, Store
from tailer.config import KafkaOptions
from tailer.messages import decode_cell_value, encode_cell
from tailer.publishers.kafka import KafkaPublisher
from tailer.security import PLAINTEXT, KafkaSecurity

CODEC = "cellstream"


class CellCodec(codecs.Codec):
    """A tailer message's value <-> :class:`logstore.Cell`."""

    def _loads(self, s: bytes) -> Cell:
        return decode_cell_value(s)

    def _dumps(self, s: Any) -> bytes:
        if not isinstance(s, Cell):
            raise TypeError(f"the cellstream codec encodes logstore.Cell values, not {type(s).__name__}")
        return encode_cell(s).value


def register_codec(name: str = CODEC) -> None:
    """Make ``value_serializer=name`` decode tailer messages into cells (safe twice)."""
    codecs.register(name, CellCodec())


def tailer_deadletter(value: bytes) -> tuple[dict[str, Any], Failure]:
    """The cell coordinates and the failure in a record of the tailer's ``<prefix>-deadletter`` topic."""
    record = json.loads(value)
    if not isinstance(record, dict):
        raise ValueError(f"not a tailer dead-letter record: {type(record).__name__}")
    return _tailer_deadletter(record)


class DeadLetters:
    """cellstream's dead-letter queue of the app ``app`` (in ``store``), for faust agents; ``close()`` when done."""

    def __init__(self, app: str, store: str | Store, brokers: str, security: KafkaSecurity = PLAINTEXT) -> None:
        self._own_store = not isinstance(store, Store)
        self.store = logstore.open(store, create=False) if isinstance(store, str) else store
        self.entries = DeadLetterStore(self.store, app)
        self.topic = dlq_topic(app)
        self.publisher = KafkaPublisher(KafkaOptions(brokers=brokers, client_id=f"{app}.faust-dlq",
                                                     security=security))
        self._started = False

    async def deadletter(self, handler: str, event: faust.types.EventT[Any], exc: BaseException,
                         attempts: int = 1) -> DeadLetter:
        """Record ``event`` as ``handler``'s dead letter (its cell when its value is one, else its position),
        and mirror the entry to the ``<app>.dlq`` topic."""
        if not self._started:
            await self.publisher.start()
            await self.publisher.prepare_topic(self.topic, 1, 1)
            self._started = True
        message = event.message
        source = {"mode": "faust", "topic": message.topic, "partition": message.partition, "offset": message.offset}
        value = event.value
        cell: dict[str, Any] = value.coordinates() if isinstance(value, Cell) else {}
        column = value.column if isinstance(value, Cell) else str(message.topic).rsplit(".", 1)[-1]
        now = dt.datetime.now(dt.UTC)
        failure = Failure(qualified_name(type(exc)), str(exc), "".join(traceback.format_exception(exc)),
                          fingerprint(exc), is_retriable(exc))
        outcome = Outcome(False, attempts, failure, now, now)
        body = value.body if isinstance(value, Cell) else None
        entry = await asyncio.to_thread(self.entries.record, handler, column, source, cell, body, outcome)
        await mirror_deadletter(self.publisher, self.topic, entry)
        return entry

    async def close(self) -> None:
        if self._started:
            await self.publisher.stop()
            self._started = False
        if self._own_store:
            self.store.close()


__all__ = ["CODEC", "CellCodec", "DeadLetters", "register_codec", "tailer_deadletter"]
