"""What the worker needs from coordination and from where it delivers cells.

Three coordinators exist: :class:`tailer.coordinators.zookeeper.ZooKeeperCoordinator` (workers
share shards through ZooKeeper), :class:`tailer.coordinators.store.StoreCoordinator`
(offsets and ownership in the store's consumer-offsets table) and
:class:`tailer.coordinators.local.LocalCoordinator` (one process owns every shard; offsets in a
file, like Kafka Connect's standalone mode).

The worker delivers cells to a :class:`Sink`. Two exist: :class:`tailer.publishers.topics.TopicSink`
(each cell as a message on the topic of its column, through a message :class:`Publisher`: Kafka's
:class:`~tailer.publishers.kafka.KafkaPublisher` or the standalone
:class:`~tailer.publishers.directory.DirectoryPublisher`) and direct mode's
:class:`indexer.runtime.direct.HandlerSink` (the cells themselves to an app's handlers). The
worker (:mod:`tailer.worker`) is the same for every combination.

Coordinator methods block (ZooKeeper round trips); the worker calls them from a
thread. Sink and publisher methods are coroutines, but for the cheap per-cell ones.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from logstore.cell import AnyCell
from tailer.errors import PublishError
from tailer.messages import Message, encode_cell


class Claim(NamedTuple):
    """A shard this worker now owns: where to resume, and the version that fences its commits."""

    shard: int
    location: int
    version: int
    token: str
    deadlettered: int


class Offset(NamedTuple):
    """What a commit stores for a shard."""

    location: int
    deadlettered: int = 0
    last_error: dict[str, Any] | None = None


class Coordinator(ABC):
    """Who owns which shard, and where each shard's committed offset is.

    Guarantees the worker relies on: at most one worker holds a shard's claim at a
    time; a commit succeeds only for the claim's holder (others get FencedError);
    and while :meth:`lease_valid` is true no other worker can have claimed a shard
    this worker holds.
    """

    worker_id: str = ""
    # The threads the worker spreads a batch of claims or releases over (each thread's share in one call of
    # claim_many or release_many). One where claims are answered from memory: more only add thread hops.
    # A coordinator with a round trip per shard raises it.
    coordination_threads: int = 1

    @abstractmethod
    def start(self, on_change: Callable[[], None]) -> None:
        """Begin (asynchronously) to join; ``on_change`` is called from any thread when
        the assignment, the session or the leadership changes."""

    @abstractmethod
    def stop(self) -> None:
        """Leave: release membership. Safe to call twice."""

    @abstractmethod
    def assignment(self) -> tuple[int, int, frozenset[int]]:
        """(session generation, assignment epoch, shards assigned to this worker). Non-blocking. Raises the
        error that stopped the coordinator for good (its credentials refused): the worker stops with it.

        A new generation means the session was lost: every claim of an older
        generation is gone and the worker must drop those shards at once.
        """

    @abstractmethod
    def lease_valid(self) -> bool:
        """True while no other worker can have taken this worker's claims. Non-blocking."""

    @abstractmethod
    def is_leader(self) -> bool: ...

    @abstractmethod
    def claim(self, shard: int, initial: Callable[[], int]) -> Claim | None:
        """Take the shard if nobody holds it; ``initial()`` gives the location when no
        offset was ever committed. None when another worker still holds it."""

    @abstractmethod
    def commit(self, offsets: Mapping[int, tuple[Claim, Offset]]) -> dict[int, Claim | BaseException]:
        """Store offsets; per shard the updated claim, FencedError or a retriable error."""

    @abstractmethod
    def release(self, claim: Claim) -> None:
        """Give the shard up (after its last commit) so the next owner may take it now."""

    def claim_many(self, wanted: Sequence[tuple[int, Callable[[], int]]]) -> list[Claim | BaseException | None]:
        """:meth:`claim` of several shards, results in order; a claim that fails comes back as its error.
        A coordinator with a round trip per claim overrides this to overlap them."""
        out: list[Claim | BaseException | None] = []
        for shard, initial in wanted:
            try:
                out.append(self.claim(shard, initial))
            except Exception as exc:  # tried again later, like a refused claim
                out.append(exc)
        return out

    def release_many(self, claims: Sequence[Claim]) -> None:
        """:meth:`release` of several shards (overridden where round trips can overlap)."""
        for claim in claims:
            self.release(claim)

    def report_published(self, published: Mapping[int, int]) -> None:  # noqa: B027 - optional
        """Where this worker's deliveries stand past its commits: the location the sink acknowledged in each
        shard that is ahead of its committed one (the others are where their commit says). Shown by ``cellstream
        offsets`` and ``tail status``, so that a tailer between two commits is not reported behind. Kept where
        readers of the offsets find it while the worker lives; by default nowhere. Called from a thread."""


class Sink(ABC):
    """Where the worker delivers the cells of the shards it owns, each acknowledged through a future.

    What the worker's per-shard order rests on: a shard's deliveries arrive in the order handed over,
    and after a failed delivery none handed over later for the same shard is delivered before the
    worker has rewound and handed the failed cells over again (a message sink gets this from its
    :class:`Publisher`, see there). The worker commits a position only after every delivery up to
    it was acknowledged, and only after :meth:`before_commit` returned.
    """

    @abstractmethod
    async def start(self) -> None:
        """Get ready to take cells (connect, create the destinations known up front)."""

    @abstractmethod
    async def stop(self) -> None:
        """Settle or fail what was handed over, and close. Safe to call twice."""

    async def prepare(self, column: str) -> None:  # noqa: B027
        """Called before the first cell of ``column``: make its destination ready. A TailerError or a
        ConfigurationError fails the shard (it backs off and tries again)."""

    def destination(self, column: str) -> str:
        """Where the cells of ``column`` go, as dead letters name it (a topic; by default the column)."""
        return column

    #: The sink takes cells with their bodies left as stored MessagePack (:class:`~logstore.cell.PackedCell`):
    #: the worker reads them so, and never decodes the bodies.
    packed_bodies = False

    @abstractmethod
    def accept(self, cell: AnyCell) -> Any:
        """The sink's form of ``cell``, to hand to :meth:`deliver`. Raises TypeError/ValueError when the cell
        cannot be encoded and a non-retriable PublishError when the sink can never take it (too large):
        the worker dead-letters the cell in its place."""

    @abstractmethod
    async def deliver(self, shard: int, column: str, items: Sequence[Any]) -> list[tuple[asyncio.Future[Any], int]]:
        """Hand over accepted cells of one shard and column, in added_id order; returns (future, how many of
        the items it covers) pairs in order. A future fails with an error :meth:`translate` understands.

        Raises PublishError: retriable, the shard backs off and resends; not retriable, the items are
        refused as a whole (the worker hands them over one at a time to find the culprit).
        """

    #: The worker hands the pages of a read of several shards over as one delivery batch (:meth:`deliver_batch`).
    delivers_batches = False

    async def deliver_batch(
        self, runs: Sequence[tuple[int, str, Sequence[Any]]]
    ) -> list[list[tuple[asyncio.Future[Any], int]]]:
        """Hand over a delivery batch: the runs of several shards at once (each run as :meth:`deliver` takes
        one; a shard's runs in added_id order).

        Runs may share futures (a record batch, a handler job): the worker waits on each distinct future
        once, not once a run. This default delivers each run.

        Args:
            runs: (shard, column, accepted cells) of each run.

        Returns:
            For each run, what :meth:`deliver` returns for it.

        Raises:
            PublishError: as :meth:`deliver`, for the batch as a whole.
        """
        sent: list[list[tuple[asyncio.Future[Any], int]]] = []
        try:
            for shard, column, items in runs:
                sent.append(await self.deliver(shard, column, items))
        except PublishError:
            # The runs handed over already are tracked by nobody (each shard of the batch resends): their
            # outcome is read, not left unread.
            for future, _count in itertools.chain.from_iterable(sent):
                future.add_done_callback(_read_outcome)
            raise
        return sent

    @abstractmethod
    async def deadletter(self, shard: int, record: dict[str, Any]) -> asyncio.Future[Any]:
        """Record a cell the worker gives up on (:func:`tailer.messages.deadletter_record`) in the shard's
        order; the future resolves once the record is durable. Raises PublishError like :meth:`deliver`."""

    def abandon(self, shards: Iterable[int]) -> None:  # noqa: B027
        """Give up what is handed over for ``shards`` but not yet under way (the worker is about to stop or
        hand them over): their futures fail or are cancelled, so the cells are delivered again later."""

    async def before_commit(self) -> None:  # noqa: B027
        """Called before the worker commits acknowledged positions: a sink that acknowledges what it only
        buffered makes it durable here (flush-before-commit). A PublishError skips this commit (the
        positions are committed later, after a flush that succeeds); a non-retriable one stops the worker."""

    def translate(self, exc: BaseException) -> PublishError:
        """The tailer's error for a failed delivery; ``retriable`` False means the cell is refused."""
        if isinstance(exc, PublishError):
            return exc
        return PublishError(f"delivery failed: {type(exc).__name__} {exc}".rstrip(), retriable=True)

    async def after_failure(self, exc: BaseException, future: asyncio.Future[Any]) -> None:  # noqa: B027
        """Called when the delivery of ``future`` failed with ``exc`` (e.g. to replace a broken client)."""


class Publisher(ABC):
    """A message sink with acknowledgements, in per-partition order, for :class:`~tailer.publishers.topics.TopicSink`.

    What the worker's per-shard order rests on: a partition's messages are delivered in the
    order sent, and after a failed delivery none sent later on the same client is delivered
    (Kafka's idempotent producer fails them on the gap in sequence numbers). A client replaced
    after a failure (:meth:`after_failure`) settles every future of the old one first; the
    worker sends nothing more of a shard once one of its deliveries failed until it has
    rewound, so a new client carries on from the failed cell, not after it.
    """

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None:
        """Flush what was sent and close. Safe to call twice."""

    @abstractmethod
    async def prepare_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        """Create the topic, or check an existing one has ``partitions`` partitions."""

    @abstractmethod
    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        """Queue a message; the future resolves when it is acknowledged.

        Raises CellRejectedError (via the worker's caller) when the message can never
        be accepted, e.g. it is larger than the sink allows; the future fails with a
        translated PublishError when delivery fails later.
        """

    def encode(self, cell: AnyCell, value_format: Literal["json", "msgpack"]) -> Message:
        """The message for ``cell``; raises TypeError/ValueError when it cannot be encoded."""
        return encode_cell(cell, value_format)

    def abandon(self, partition: int) -> None:  # noqa: B027
        """Give up messages of ``partition`` queued but not yet under way (the worker is about to
        stop or hand the shard over): their futures fail, so the cells are sent again later."""

    async def before_commit(self) -> None:  # noqa: B027
        """Called before the worker commits acknowledged positions: a sink that acknowledges what it only
        buffered makes it durable here (flush-before-commit). A PublishError skips this commit (the
        positions are committed later, after a flush that succeeds); a non-retriable one stops the worker."""

    def refuses(self, message: Message) -> PublishError | None:
        """The non-retriable error if the sink can never accept ``message`` (e.g. too large), else None."""
        return None

    async def send_many(
        self, topic: str, partition: int, messages: Sequence[Message]
    ) -> list[tuple[asyncio.Future[Any], int]]:
        """Queue messages for one partition, in order; returns (future, how many messages it covers) pairs.

        Raises PublishError (some messages may be queued by then); the caller checks
        ``refuses`` first, so a non-retriable one is unexpected.
        """
        return [(await self.send(topic, partition, m.key, m.value, m.headers), 1) for m in messages]

    def translate(self, exc: BaseException) -> PublishError:
        """The tailer's error for a failed delivery; ``retriable`` False means the cell is rejected."""
        if isinstance(exc, PublishError):
            return exc
        return PublishError(f"delivery failed: {type(exc).__name__} {exc}".rstrip(), retriable=True)

    async def after_failure(self, exc: BaseException, future: asyncio.Future[Any]) -> None:  # noqa: B027
        """Called when the delivery of ``future`` failed with ``exc`` (e.g. to replace a broken client)."""


def _read_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
