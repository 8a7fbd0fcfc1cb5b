"""Consumer offsets as an operator sees them: every place a consumer of a store keeps its positions, read,
shown with its lag, and reset (``cellstream offsets``), each reset recorded.

One :class:`~tailer.offsets.places.OffsetsPlace` per place positions live: the store itself
(:mod:`~tailer.offsets.store`: apps, connectors, store-coordinated tailers, a migration's flow back),
ZooKeeper (:mod:`~tailer.offsets.zookeeper`: distributed tailers and apps), a standalone tailer's offsets file
(:mod:`~tailer.offsets.file`) and a Kafka consumer group (:mod:`~tailer.offsets.kafka`: Kafka-mode apps).
"""

from tailer.offsets.history import ResetHistory, ResetRecord
from tailer.offsets.places import ConsumerPositions, OffsetsPlace, PositionRow, ResetPlan

__all__ = ["ConsumerPositions", "OffsetsPlace", "PositionRow", "ResetHistory", "ResetPlan", "ResetRecord"]
