"""Offsets kept by a Kafka consumer group: Kafka-mode apps (group ``app.NAME``) on the tailer's topics. Its
positions are partition offsets, not shard locations: a reset goes to ``beginning``, ``end`` or a time (the
messages' timestamps, set when the tailer published them), each partition at once. As Kafka's own
``kafka-consumer-groups --reset-offsets`` does, it is refused while the group has members."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from logstore.errors import InvalidArgumentError
from logstore.positions import Position
from logstore.retry import RetryPolicy, retry_call_async
from tailer.errors import ConsumerNotFoundError, ConsumerRunningError, CoordinationError
from tailer.offsets.history import new_reset_id
from tailer.offsets.places import ConsumerPositions, OffsetsPlace, PositionRow, ResetPlan
from tailer.security import PLAINTEXT, KafkaSecurity

_T = TypeVar("_T")
# A fresh broker answers "coordinator not available" for a few seconds while it creates __consumer_offsets.
_RETRY = RetryPolicy(initial=0.1, maximum=1.0, deadline=30.0)


class KafkaGroupOffsets(OffsetsPlace):
    """The consumer groups at ``brokers`` whose ids start with ``prefix``; with ``topic_prefix``, only those with
    offsets on that tailer's topics (``<topic_prefix>.<column>``, ``<topic_prefix>-deadletter``): the Kafka-mode
    apps of one store, where a cluster serves several."""

    kind = "kafka"

    def __init__(self, brokers: str, *, prefix: str = "app.", topic_prefix: str | None = None,
                 security: KafkaSecurity = PLAINTEXT) -> None:
        self.brokers = brokers
        self.prefix = prefix
        self.topic_prefix = topic_prefix
        self.security = security
        self.where = f"kafka {brokers}" + (f" (topics {topic_prefix}.*)" if topic_prefix else "")

    def _ours(self, topic: str) -> bool:
        return self.topic_prefix is None or topic.startswith(f"{self.topic_prefix}.") \
            or topic == f"{self.topic_prefix}-deadletter"

    def _run(self, fn: Callable[[AIOKafkaAdminClient, AIOKafkaConsumer], Awaitable[_T]]) -> _T:
        async def run() -> _T:
            options = self.security.client_options()
            admin = AIOKafkaAdminClient(bootstrap_servers=self.brokers, client_id="cellstream.offsets", **options)
            probe = AIOKafkaConsumer(bootstrap_servers=self.brokers, client_id="cellstream.offsets",
                                     enable_auto_commit=False, **options)
            try:
                await admin.start()
                await probe.start()
                return await fn(admin, probe)
            except (KafkaError, OSError) as exc:
                raise CoordinationError(f"Kafka at {self.brokers}: {type(exc).__name__}: {exc}") from None
            finally:
                await probe.stop()
                await admin.close()
        return asyncio.run(run())

    def consumers(self) -> list[str]:
        async def run(admin: AIOKafkaAdminClient, _probe: AIOKafkaConsumer) -> list[str]:
            groups = await retry_call_async(admin.list_consumer_groups, _RETRY)
            names = sorted(str(group[0]) for group in groups if str(group[0]).startswith(self.prefix))
            if self.topic_prefix is None:
                return names
            kept = []
            for name in names:  # a request a group: only with a topic prefix, to leave other stores' apps out
                committed = await retry_call_async(functools.partial(admin.list_consumer_group_offsets, name), _RETRY)
                if any(self._ours(tp.topic) for tp in committed):
                    kept.append(name)
            return kept
        return self._run(run)

    async def _state(self, admin: AIOKafkaAdminClient, probe: AIOKafkaConsumer, name: str
                     ) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int], list[str]]:
        committed = await retry_call_async(lambda: admin.list_consumer_group_offsets(name), _RETRY)
        found = {tp: meta.offset for tp, meta in committed.items() if meta is not None and meta.offset >= 0}
        if not found:
            raise ConsumerNotFoundError(f"no consumer group named {name!r} with committed offsets at {self.brokers}")
        ends = await retry_call_async(lambda: probe.end_offsets(sorted(found)), _RETRY)
        described = await retry_call_async(lambda: admin.describe_consumer_groups([name]), _RETRY)
        return found, ends, _members(described)

    def positions(self, name: str) -> ConsumerPositions:
        async def run(admin: AIOKafkaAdminClient, probe: AIOKafkaConsumer) -> ConsumerPositions:
            found, ends, members = await self._state(admin, probe, name)
            rows = [PositionRow(f"{tp.topic}/{tp.partition}", None, offset, ends[tp], max(0, ends[tp] - offset))
                    for tp, offset in sorted(found.items())]
            return ConsumerPositions(name, self.kind, self.where, rows, members,
                                     "positions are partition offsets; lag in messages")
        return self._run(run)

    def plan_reset(self, name: str, position: Position, shards: list[int] | None) -> ResetPlan:
        if shards is not None or position.kind == "locations":
            raise InvalidArgumentError("a Kafka group's positions are partition offsets, each partition holding "
                                       "many shards: reset it --to beginning, end or a time, without --shards")

        async def run(admin: AIOKafkaAdminClient, probe: AIOKafkaConsumer) -> ResetPlan:
            found, _ends, members = await self._state(admin, probe, name)
            partitions = sorted(found)
            if position.kind == "beginning":
                targets = await probe.beginning_offsets(partitions)
            elif position.kind == "end":
                targets = await probe.end_offsets(partitions)
            else:
                assert position.when is not None
                stamp = int(position.when.timestamp() * 1000)
                at = await probe.offsets_for_times(dict.fromkeys(partitions, stamp))
                ends = await probe.end_offsets(partitions)
                targets = {tp: ends[tp] if at.get(tp) is None else at[tp].offset for tp in partitions}
            changes: list[tuple[str, int | None, int]] = [
                (f"{tp.topic}/{tp.partition}", found[tp], int(targets[tp])) for tp in partitions]
            return ResetPlan(name, self.kind, self.where, str(position), changes, members)
        return self._run(run)

    def execute(self, plan: ResetPlan) -> ResetPlan:
        reset_id = new_reset_id()

        async def run(admin: AIOKafkaAdminClient, _probe: AIOKafkaConsumer) -> None:
            described = await retry_call_async(lambda: admin.describe_consumer_groups([plan.name]), _RETRY)
            members = _members(described)
            if members:
                raise ConsumerRunningError(f"consumer group {plan.name} has {len(members)} members "
                                           f"({', '.join(members)}): stop them, then reset its offsets", members)
            offsets = {}
            for key, _before, after in plan.changes:
                topic, _, partition = key.rpartition("/")
                offsets[TopicPartition(topic, int(partition))] = OffsetAndMetadata(after, f"reset {reset_id}")
            # A consumer of the group that joins nothing: its commit is the offset commit of an empty group
            # (generation -1), which the broker refuses while the group has members.
            writer = AIOKafkaConsumer(bootstrap_servers=self.brokers, group_id=plan.name, enable_auto_commit=False,
                                      client_id="cellstream.offsets", **self.security.client_options())
            await writer.start()
            try:
                writer.assign(sorted(offsets))
                await writer.commit(offsets)
            finally:
                await writer.stop()
        self._run(run)
        plan.reset_id = reset_id
        return plan


def _members(described: list[Any]) -> list[str]:
    """``client_id@host (member_id)`` of every member of the described groups."""
    out = []
    for response in described:
        for group in response.groups:
            for member in group[5]:
                member_id, client_id, host = member[0], member[-4], member[-3]
                out.append(f"{client_id}@{str(host).lstrip('/')} ({member_id})")
    return out
