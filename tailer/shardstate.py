"""The worker's bookkeeping per owned shard, and the shape of its reads (see :mod:`tailer.worker`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, cast

from logstore import ChangedCounts, CorruptCellError, LogstoreError, UndecodedPages
from logstore.cell import AnyCell, Cell, PackedCell
from tailer.interfaces import Claim

# A read's result per shard: its page, or the error that ended it (a CorruptCellError holds the cells before).
Pages = dict[int, Sequence[AnyCell] | LogstoreError]
# What a read thread hands the loop: the pages, still to be decoded (on the loop), or each shard's read error.
Read = UndecodedPages | Pages
# A drained shard's (count seen, position) as a count poll compares it.
Drained = tuple[int | None, int]
# A count poll's result: (the cell counts, if read; the drained shards whose count moved, as compared; their
# pages; seconds the counting took).
CountPoll = tuple[ChangedCounts | None, dict[int, Drained], Read, float]


def decoded(read: Read) -> Pages:
    """A read's pages, decoded on the calling thread: the loop's (see :class:`logstore.UndecodedPages`)."""
    if isinstance(read, UndecodedPages):
        return cast(Pages, read.decode())  # a fresh dict of pages and CorruptCellErrors: Pages' values, not copied
    return read


class Pending(NamedTuple):
    added_id: int  # of the last cell the future covers
    future: asyncio.Future[Any]
    source: AnyCell | dict[str, Any]  # the first cell, or a dead letter's coordinates
    topic: str
    deadletter: bool
    messages: int = 1  # how many the future covers (a record batch); 0: cells of reserved columns passed over

    @property
    def where(self) -> dict[str, Any]:
        return self.source.coordinates() if isinstance(self.source, Cell | PackedCell) else self.source


@dataclasses.dataclass(slots=True)  # no __dict__ per shard: thousands are owned, and the collector walks them
class ShardState:
    claim: Claim
    position: int
    acked: int
    committed: int
    deadlettered: int
    inflight: deque[Pending] = dataclasses.field(default_factory=deque)
    last_error: dict[str, Any] | None = None
    retry_at: float = 0.0
    backoff: Iterator[float] | None = None
    singles_until: int = 0  # after a refused batch: one message at a time until this is acked
    count_seen: int | None = None
    drained: bool = False
    reading: asyncio.Future[Read] | None = None  # the read batch this shard's next page is in
    read_from: int = 0
    read_limit: int = 0
    read_reserved: int = 0
    # A field, not a property of the claim: the loop reads it a dozen times per page of every shard.
    shard: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.shard = self.claim.shard


def page_of(pages: Pages, shard: int) -> tuple[Sequence[AnyCell], BaseException | None]:
    """A shard's page of a read as (good cells, what ended it early)."""
    page = pages[shard]
    if isinstance(page, CorruptCellError):
        return page.cells_before, page
    if isinstance(page, LogstoreError):
        return [], page
    return page, None

