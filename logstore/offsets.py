"""A consumer's offsets on one storage node, kept as one row.

Each backend stores a consumer's positions in the node's shards as one MessagePack value in one row
(``cellstream_consumers``), read and written whole inside a write transaction. They were a row per shard
(``cellstream_offsets``, moved over when a node opens): a claim and a commit of 4096 shards then wrote
4096 rows, which cost an app more than a drain of a few cells a shard (on SQLite 7-10 ms a commit, on
MariaDB 30-45 ms). The row holds, in order, the distinct owners and docs, then per shard its number,
location (None before its first commit), owner and doc as indexes into those lists: most shards share
an owner and a doc, and ints pack and parse quickly.

Fencing stays per shard: a commit changes only the shards its owner still holds.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import orjson

from logstore.errors import StorageError

_VERSION = 1
EMPTY_DOC = "{}"
#: The owner an offsets reset takes shards over with (``reset:ID``): a reset's, not a process's.
RESET_OWNER = "reset:"


def is_reset_owner(owner: str) -> bool:
    """Whether ``owner`` is an offsets reset's (``cellstream offsets reset``) rather than a consumer process's."""
    return owner.startswith(RESET_OWNER)


class OffsetRecord(NamedTuple):
    """A consumer's committed position in one shard; ``location`` None when it never committed. The records of
    one claim may share a ``doc`` object: read it, never change it."""

    shard: int
    location: int | None
    owner: str
    doc: dict[str, Any]


class ConsumerOffsets:
    """One consumer's offsets on one node, decoded from its row: change them, then :meth:`encode` them back."""

    __slots__ = ("_doc_index", "_index", "doc_of", "docs", "locations", "owner_of", "owners", "shards")

    def __init__(self) -> None:
        self.owners: list[str] = []
        self.docs: list[str] = []
        self.shards: list[int] = []
        self.locations: list[int | None] = []
        self.owner_of: list[int] = []
        self.doc_of: list[int] = []
        self._index: dict[int, int] = {}
        self._doc_index: dict[str, int] | None = None

    @classmethod
    def decode(cls, data: bytes | None, where: str) -> ConsumerOffsets:
        """The offsets in a row's value (None: no row yet); ``where`` names the row in an error."""
        out = cls()
        if not data:
            return out
        try:
            version, out.owners, out.docs, out.shards, out.locations, out.owner_of, out.doc_of = msgpack.unpackb(data)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise StorageError(f"the offsets of {where} cannot be read: {exc}") from None
        if version != _VERSION or not (len(out.shards) == len(out.locations) == len(out.owner_of)
                                       == len(out.doc_of)):
            raise StorageError(f"the offsets of {where} have an unknown layout (version {version})")
        out._index = dict(zip(out.shards, range(len(out.shards)), strict=True))
        return out

    @classmethod
    def of_rows(cls, rows: Iterable[Sequence[Any]]) -> ConsumerOffsets:
        """The offsets of (shard, location, owner, doc) rows: those of the table a row per shard."""
        out = cls()
        for shard, location, owner, doc in rows:
            text = doc.decode() if isinstance(doc, bytes) else str(doc)
            out._set(int(shard), None if location is None else int(location), out._owner(str(owner)), out._doc(text))
        return out

    def encode(self) -> bytes:
        """The row's value; owners and docs no shard refers to any more are dropped."""
        owners, owner_of = _compacted(self.owners, self.owner_of)
        docs, doc_of = _compacted(self.docs, self.doc_of)
        packed: bytes = msgpack.packb([_VERSION, owners, docs, self.shards, self.locations, owner_of, doc_of])
        return packed

    def claim(self, owner: str, shards: Iterable[int]) -> None:
        """``owner`` holds ``shards`` from now on (the ones never claimed start with no location)."""
        me = self._owner(owner)
        index, owner_of = self._index, self.owner_of
        fresh: list[int] = []
        for shard in shards:
            at = index.get(shard)
            if at is None:
                fresh.append(shard)
            else:
                owner_of[at] = me
        if fresh:  # a new consumer's thousands of shards at once, not a shard at a time
            first, doc = len(self.shards), self._doc(EMPTY_DOC)
            index.update(zip(fresh, range(first, first + len(fresh)), strict=True))
            self.shards += fresh
            self.locations += [None] * len(fresh)
            self.owner_of += [me] * len(fresh)
            self.doc_of += [doc] * len(fresh)

    def commit(self, owner: str, offsets: Mapping[int, tuple[int, str]]) -> set[int]:
        """Set (location, doc) of the shards ``owner`` holds; return the others (fenced), which stay as they were."""
        try:
            me = self.owners.index(owner)
        except ValueError:
            return set(offsets)
        fenced: set[int] = set()
        index, owner_of, locations, doc_of, doc = self._index, self.owner_of, self.locations, self.doc_of, self._doc
        for shard, (location, text) in offsets.items():
            at = index.get(shard)
            if at is None or owner_of[at] != me:
                fenced.add(shard)
                continue
            locations[at] = location
            doc_of[at] = doc(text)
        return fenced

    def __contains__(self, shard: object) -> bool:
        """Whether the offsets hold a record of ``shard``."""
        return shard in self._index

    def carry(self, other: ConsumerOffsets, shard: int) -> bool:
        """Take ``other``'s record of ``shard`` (location, owner and doc) in place of this one's, as a shard move
        carries it from node to node; False (nothing changed) when ``other`` holds none."""
        at = other._index.get(shard)
        if at is None:
            return False
        self._set(shard, other.locations[at], self._owner(other.owners[other.owner_of[at]]),
                  self._doc(other.docs[other.doc_of[at]]))
        return True

    def records(self, wanted: set[int] | None = None) -> list[OffsetRecord]:
        """The records of ``wanted`` shards (default: all), by shard; each distinct doc parsed once and shared."""
        owners = self.owners
        docs = [parse_offset_doc(doc) for doc in self.docs]
        rows = zip(self.shards, self.locations, self.owner_of, self.doc_of, strict=True)
        out = [OffsetRecord(shard, location, owners[owner], docs[doc]) for shard, location, owner, doc in rows
               if wanted is None or shard in wanted]
        out.sort(key=_by_shard)
        return out

    def _set(self, shard: int, location: int | None, owner: int, doc: int) -> None:
        at = self._index.get(shard)
        if at is None:
            self._index[shard] = len(self.shards)
            self.shards.append(shard)
            self.locations.append(location)
            self.owner_of.append(owner)
            self.doc_of.append(doc)
        else:
            self.locations[at], self.owner_of[at], self.doc_of[at] = location, owner, doc

    def _owner(self, owner: str) -> int:
        try:
            return self.owners.index(owner)
        except ValueError:
            self.owners.append(owner)
            return len(self.owners) - 1

    def _doc(self, text: str) -> int:
        known = self._doc_index
        if known is None:
            known = self._doc_index = {d: i for i, d in enumerate(self.docs)}
        at = known.get(text)
        if at is None:
            at = known[text] = len(self.docs)
            self.docs.append(text)
        return at


def move_old_offsets(rows: Iterable[Sequence[Any]], save: Callable[[str, bytes], object], kept: set[str]) -> int:
    """Save the offsets of (consumer, shard, location, owner, doc) ``rows`` of the table a row per shard (sorted by
    consumer) as a row per consumer, except the consumers ``kept`` already has; return how many were saved."""
    moved = 0
    for consumer, group in itertools.groupby(rows, key=_consumer):
        if consumer not in kept:
            save(consumer, ConsumerOffsets.of_rows(row[1:] for row in group).encode())
            moved += 1
    return moved


def _consumer(row: Sequence[Any]) -> str:
    return str(row[0])


def _compacted(values: list[str], refs: list[int]) -> tuple[list[str], list[int]]:
    used = set(refs)
    if len(used) == len(values):
        return values, refs
    kept = sorted(used)
    moved = {old: new for new, old in enumerate(kept)}
    return [values[i] for i in kept], [moved[i] for i in refs]


def _by_shard(record: OffsetRecord) -> int:
    return record.shard


def parse_offset_doc(doc: str | bytes) -> dict[str, Any]:
    try:
        parsed: dict[str, Any] = orjson.loads(doc)
    except orjson.JSONDecodeError:  # NaN and Infinity, which older versions' json.dumps could store
        parsed = json.loads(doc)
    return parsed


_DOC_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS  # to default=str, as json does


def offset_doc(doc: Mapping[str, Any]) -> str:
    """An offset's doc as stored: compact JSON in ASCII (any column charset holds it), values JSON cannot
    hold as their ``str``. orjson writes it where its output is ASCII, json.dumps otherwise (and where orjson
    refuses: keys that are not strings, integers over 64 bits); a commit writes one per shard."""
    try:
        out = orjson.dumps(doc, default=str, option=_DOC_OPTIONS)
        if out.isascii():
            return out.decode()
    except TypeError:
        pass
    return json.dumps(doc, separators=(",", ":"), default=str)
