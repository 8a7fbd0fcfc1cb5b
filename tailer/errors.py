"""The tailer error hierarchy.

Every error raised by the tailer is a :class:`TailerError` or the project's
:class:`ConfigurationError`; ``retriable`` tells the
caller whether the same call may succeed later. Kafka (aiokafka) errors are
translated in :mod:`tailer.publishers.kafka` and ZooKeeper (kazoo) errors in
:mod:`tailer.coordinators.zookeeper`; neither escapes untranslated.
"""

from __future__ import annotations

from typing import Any

from logstore.errors import CellstreamError
from logstore.errors import ConfigurationError as ConfigurationError  # the project's one class, re-exported


class TailerError(CellstreamError):
    """Root of every tailer error but :class:`ConfigurationError`, the project's one class for options that do
    not fit (here: the tailer's options, or a topic that exists with another partition count)."""


class CoordinationError(TailerError):
    """ZooKeeper cannot be reached or timed out. Retriable: owned shards keep publishing."""

    retriable = True


class FencedError(TailerError):
    """This worker no longer owns the shard: another worker claimed it, so the commit was refused.

    The worker must stop publishing the shard; its committed offset stays where the
    new owner found it, so offsets never move backwards.
    """

    def __init__(self, shard: int, detail: str) -> None:
        self.shard = shard
        super().__init__(f"shard {shard}: {detail}")


class PublishError(TailerError):
    """A message could not be published. ``retriable`` says whether resending may work."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        self.retriable = retriable
        super().__init__(message)


class CellRejectedError(PublishError):
    """This cell can never be published as it is (too large for the broker, not encodable).

    The tailer dead-letters it, with ``cell`` naming its coordinates, and goes on.
    """

    def __init__(self, cell: dict[str, Any], problem: str) -> None:
        self.cell = cell
        self.problem = problem
        super().__init__(
            f"cell ({cell.get('row_key')}, {cell.get('column')}, {cell.get('ref_key')}) of shard "
            f"{cell.get('shard')} at added_id {cell.get('added_id')}: {problem}",
            retriable=False,
        )


class TopicPartitionsError(ConfigurationError):
    """A topic exists with another partition count than the tailer maps shards onto (shard mod ``needed``), so
    the column's cells cannot keep their shard's order there. The message says how to fix the topic. ``logged``
    is set once the sink has logged it: the same refusal, raised again for every later attempt, need not be."""

    def __init__(self, topic: str, found: int, needed: int, fix: str) -> None:
        self.topic = topic
        self.found = found
        self.needed = needed
        self.logged = False
        super().__init__(f"topic {topic} has {found} partitions but the tailer maps shards onto {needed} (shard mod "
                         f"{needed}): its column is not published until they match. {fix}")


class ConsumerNotFoundError(TailerError):
    """No consumer of that name keeps offsets in the place asked."""


class ConsumerRunningError(TailerError):
    """The consumer's offsets are held by running processes (named in the message) and its place cannot
    coordinate a reset with them: stop them first, as Kafka asks of a group before resetting it."""

    def __init__(self, message: str, holders: list[str]) -> None:
        self.holders = holders
        super().__init__(message)
