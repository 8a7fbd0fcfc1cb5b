"""Secondary index tables: what an index version is, its records, and what every backend implements.

An index version (an :class:`IndexSpec`) is one *entry table* per storage node,
partitioned into the instance's shards by the hash of the entry's shard field
(:func:`shard_of_value`): an entry lives in exactly one shard, on the node holding
that shard. Beside it, a *locator table* in each row's own shard records the
ref_key of the cell the row's entry reflects and the shard the entry lives in.

Applying a batch of changes (:meth:`IndexRecorder.apply`) on the node of the
changes' source shards is one transaction that
1. drops changes at or below the stream's recorded position (applied already),
2. locks and reads the rows' locators,
3. plans the writes (:func:`plan`): a change older than or equal to the row's
   locator is a no-op; a newer one puts the entry in its shard and deletes the copy
   in the old shard when the shard field changed; a newer *removal* (a tombstone's
   change, ``values`` None) deletes the entry where the locator says it is and
   leaves a locator at its ref_key with entry shard :data:`NO_ENTRY`, so an older
   change delivered later is still superseded,
4. hands the writes for other nodes to ``remote`` (each node its own transaction,
   idempotent: guarded by ref_key), then writes its own, the locators and the new
   position, and commits.
The locators commit last, so a crash in between leaves them at the old state and
the redelivered batch plans the same writes again. Entries are therefore always
those of each row's highest applied ref_key, whatever the order of delivery.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import math
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from logstore.errors import InvalidArgumentError

FieldType = Literal["uuid", "str", "int", "float", "bool", "datetime", "json"]
Order = Literal["asc", "desc"]
Stream = Literal["live", "backfill"]
SHARDABLE = frozenset({"uuid", "str", "int"})
RESERVED = frozenset({"row_key", "ref_key", "added_id", "shard", "created_at"})  # the entry's own columns
MAX_KEYS = 5  # a composite index of the shard and up to five keys stays under InnoDB's 3072-byte limit
MAX_KEY_CHARS = 128  # a str query key; other str fields are unbounded
OPERATORS = frozenset({"=", ">", ">=", "<", "<="})
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class IndexColumn(BaseModel):
    """One field copied into the entries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z_][a-z0-9_]{0,63}$", description="the body field, and the entry's column")
    type: FieldType
    key: bool = Field(False, description="queries may filter on it (equality, or a range)")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value in RESERVED:
            raise ValueError(f"{value!r} is reserved for the entry's own columns ({', '.join(sorted(RESERVED))})")
        return value


class IndexSpec(BaseModel):
    """An index version as the storage nodes hold it: its name, version, shard field and typed fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,47}$", description="also part of the index tables' names")
    version: int = Field(ge=1, le=9999, description="a new version is built beside the old one, then activated")
    shard_field: str = Field(description="the field whose hash picks the entry's shard")
    fields: list[IndexColumn] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _consistent(self) -> IndexSpec:
        names = [f.name for f in self.fields]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"fields: {', '.join(twice)} declared more than once")
        shard = {f.name: f for f in self.fields}.get(self.shard_field)
        if shard is None:
            raise ValueError(f"shard_field: {self.shard_field!r} is not one of the fields ({', '.join(names)})")
        if shard.type not in SHARDABLE:
            raise ValueError(f"shard_field: {self.shard_field!r} has type {shard.type}; it must be uuid, str or int")
        for f in self.fields:
            if f.key and f.type == "json":
                raise ValueError(f"fields: {f.name!r} is json, which cannot be a query key")
        if len(self.keys) > MAX_KEYS:
            raise ValueError(f"fields: {len(self.keys)} query keys (the shard field counts); at most {MAX_KEYS}")
        return self

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        """The query keys: the shard field first, then the fields marked ``key``, in declaration order."""
        return (self.shard_field, *(f.name for f in self.fields if f.key and f.name != self.shard_field))

    @property
    def table(self) -> str:
        return f"ix_{self.name}_v{self.version}"

    @property
    def locator_table(self) -> str:
        return f"ixl_{self.name}_v{self.version}"

    @functools.cached_property
    def _encode(self) -> Callable[[Mapping[str, Any]], list[Any]]:
        return row_encoder(self)

    @functools.cached_property
    def _by_name(self) -> dict[str, IndexColumn]:
        return {f.name: f for f in self.fields}

    def field(self, name: str) -> IndexColumn:
        found = self._by_name.get(name)
        if found is not None:
            return found
        raise InvalidArgumentError(f"index {self.name} has no field {name!r} (fields: "
                                   f"{', '.join(f.name for f in self.fields)})")

    def storage_json(self) -> str:
        """The spec as the nodes record it: a node refuses another spec under the same table."""
        return json.dumps(IndexSpec.model_validate(self, from_attributes=True).model_dump(mode="json"),
                          sort_keys=True, separators=(",", ":"))


class IndexChange(NamedTuple):
    """A cell's entry on its way into the index: where the cell is in the log, and the typed values."""

    shard: int  # the cell's own shard (its locator lives there)
    added_id: int
    row_key: uuid.UUID
    ref_key: int
    values: dict[str, Any] | None  # None: a removal (the cell is a tombstone): the row has no entry from it on


class IndexEntry(NamedTuple):
    """An entry as a query returns it."""

    shard: int  # the shard of the shard field's value
    row_key: uuid.UUID
    ref_key: int
    fields: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        out = {"row_key": str(self.row_key), "ref_key": self.ref_key, "shard": self.shard}
        for name, value in self.fields.items():
            out[name] = (str(value) if isinstance(value, uuid.UUID)
                         else value.isoformat() if isinstance(value, dt.datetime) else value)
        return out


NO_ENTRY = -1  # a locator's entry shard when its cell removed the row's entry (a tombstone)


class Locator(NamedTuple):
    ref_key: int  # of the cell the row's entry reflects (or that removed it)
    entry_shard: int  # NO_ENTRY: the row has no entry (its ref_key >= 0; a placeholder's is negative)


class EntryWrite(NamedTuple):
    """Put ``values`` at (shard, row_key) unless an entry of a ref_key >= this one is there; with
    ``values`` None, delete the entry at (shard, row_key) if its ref_key is lower. A ``force``d write
    (a repair, under the row's locator lock) puts or deletes whatever is there."""

    shard: int
    row_key: uuid.UUID
    ref_key: int
    values: dict[str, Any] | None
    force: bool = False
    row: list[Any] | None = None  # ``values`` encoded (encode_row), when the caller has it already

    def encoded(self, spec: IndexSpec) -> list[Any]:
        return self.row if self.row is not None else encode_row(spec, self.values or {})


class Fix(NamedTuple):
    """A repair of one row, found by verification: its entry becomes the one of cell ``ref_key`` with
    ``values`` in ``entry_shard``, whatever the index holds, and its copies in the ``clear`` shards are
    deleted. With ``values`` None the row has no entry: its locator is deleted when ``ref_key`` is -1 (no
    cell), or records the removal (``ref_key``, NO_ENTRY) when ``ref_key`` is a tombstone's."""

    shard: int  # the row's own shard, where its locator lives
    row_key: uuid.UUID
    ref_key: int  # -1 without values and without a tombstone
    entry_shard: int  # NO_ENTRY without values
    values: dict[str, Any] | None
    clear: tuple[int, ...] = ()


class Condition(NamedTuple):
    field: str
    op: str
    value: Any


class ApplyResult(NamedTuple):
    applied: int = 0  # changes that set their row's entry
    superseded: int = 0  # older than (or the same as) the row's entry: no-ops
    skipped: int = 0  # at or below the stream's position: applied before

    def __add__(self, other: tuple[int, ...]) -> ApplyResult:  # type: ignore[override]
        return ApplyResult(*(a + b for a, b in zip(self, other, strict=True)))


class IndexPosition(NamedTuple):
    """How far a stream (live processing, or a backfill) applied a source shard's log."""

    shard: int
    location: int
    target: int | None  # a backfill's end: the shard's head when it started


class StrayRows(NamedTuple):
    """A version's index rows that a storage node keeps in a shard the shard map gives another node: the
    source copy of a moved shard until it is dropped, or the copy a move under way (or stopped before its
    switch) writes on its target. Queries and verification read every shard on its holder only."""

    node: str
    shard: int
    rows: int  # the version's entries, locators and positions in the shard, on that node
    moved: bool  # the node recorded the shard's move away (or an aborted move to it): the rows are dead, and
    # ``index verify --repair`` deletes them; else a move under way, or stopped before its switch, wrote them


# -- values -------------------------------------------------------------------------------
def shard_of_value(kind: str, value: Any, shards: int) -> int:
    """The shard of an entry by its shard field: BLAKE2b like a row's shard. A uuid hashes its 16
    bytes, so an entry keyed by an entity's UUID lands in that entity's own row's shard."""
    if kind == "uuid":
        raw = value.bytes
    elif kind == "str":
        raw = value.encode()
    else:
        raw = int(value).to_bytes(8, "big", signed=True)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big") % shards


def micros(when: dt.datetime) -> int:
    delta = when - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def _wrong(value: Any) -> Any:
    raise TypeError


_INT64 = range(-(1 << 63), 1 << 63)
# Each type's stored form of a value; TypeError when the value has another type.
_ENCODE: dict[str, Callable[[Any], Any]] = {
    "uuid": lambda v: v.bytes if isinstance(v, uuid.UUID) else _wrong(v),
    "str": lambda v: v if isinstance(v, str) else _wrong(v),
    "int": lambda v: v if type(v) is int and v in _INT64 else _wrong(v),
    "float": lambda v: float(v) if type(v) in (int, float) and math.isfinite(v) else _wrong(v),
    "bool": lambda v: int(v) if type(v) is bool else _wrong(v),
    "datetime": lambda v: micros(v) if isinstance(v, dt.datetime) and v.utcoffset() is not None else _wrong(v),
    "json": lambda v: v,  # dumped below, where a value that is not JSON gets its own message
}


def encode_value(index: str, column: IndexColumn, value: Any, is_key: bool) -> Any:
    """A typed value as the backends store it; InvalidArgumentError names a value of the wrong type."""
    if value is None:
        if is_key:
            raise InvalidArgumentError(f"index {index}: key field {column.name} needs a value, got None")
        return None
    kind = column.type
    try:
        stored = _ENCODE[kind](value)
    except TypeError:
        raise InvalidArgumentError(f"index {index}: field {column.name} is {kind}, got "
                                   f"{type(value).__name__} {value!r:.60}") from None
    if kind == "str" and is_key and len(value) > MAX_KEY_CHARS:
        raise InvalidArgumentError(f"index {index}: key field {column.name} is longer than {MAX_KEY_CHARS} characters")
    if kind == "json":
        try:
            return json.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"index {index}: field {column.name} is not a JSON value: {exc}") from None
    return stored


def _text(raw: Any) -> Any:
    return bytes(raw).decode() if isinstance(raw, bytes | bytearray) else raw


def encode_row(spec: IndexSpec, values: Mapping[str, Any]) -> list[Any]:
    """The stored form of every field of an entry, in declaration order."""
    try:
        return spec._encode(values)
    except (_Slow, KeyError, TypeError):  # a value the fast path does not take: the checked path decides
        pass
    keys = spec.keys
    missing = [f.name for f in spec.fields if f.name not in values]
    if missing:
        raise InvalidArgumentError(f"index {spec.name}: entry lacks {', '.join(missing)}")
    return [encode_value(spec.name, f, values[f.name], f.name in keys) for f in spec.fields]


class _Slow(Exception):
    """The generated encoder met a value it does not take (wrong type, None, out of range, a subclass)."""


# Each type's fast test and stored form (v: the value); what fails the test takes the checked path.
_FAST = {"uuid": ("type({v}) is UUID", "{v}.bytes"),
         "str": ("type({v}) is str", "{v}"),
         "int": ("type({v}) is int and -9223372036854775808 <= {v} <= 9223372036854775807", "{v}"),
         "float": ("type({v}) is float and {v} - {v} == 0.0", "{v}"),  # finite: inf - inf and nan are nan
         "bool": ("type({v}) is bool", "int({v})"),
         "datetime": ("type({v}) is datetime and {v}.utcoffset() is not None", "micros({v})"),
         "json": ("False", "{v}")}


def row_encoder(spec: IndexSpec) -> Callable[[Mapping[str, Any]], list[Any]]:
    """:func:`encode_row`'s fast path for one spec, generated like :func:`entry_decoder`: it raises
    _Slow for any value that needs the checked path (which also words the errors)."""
    keys, lines, out = spec.keys, [], []
    for n, f in enumerate(spec.fields):
        test, expr = (part.format(v=f"v{n}") for part in _FAST[f.type])
        if f.type == "str" and f.name in keys:
            test += f" and len(v{n}) <= {MAX_KEY_CHARS}"
        lines.append(f"    v{n} = values[{f.name!r}]")
        if f.name in keys:
            lines.append(f"    if not ({test}): raise _Slow")
            out.append(expr)
        else:
            lines.append(f"    if v{n} is not None and not ({test}): raise _Slow")
            out.append(f"None if v{n} is None else {expr}")
    source = "def encode(values):\n" + "\n".join(lines) + f"\n    return [{', '.join(out)}]\n"
    scope: dict[str, Any] = {"_Slow": _Slow, "UUID": uuid.UUID, "datetime": dt.datetime, "micros": micros}
    exec(source, scope)  # the source is built from the validated spec only
    encode: Callable[[Mapping[str, Any]], list[Any]] = scope["encode"]
    return encode


_DECODE_EXPR = {"uuid": "UUID(bytes={v})", "str": "_text({v})", "int": "{v}", "float": "float({v})",
                "bool": "bool({v})", "datetime": "EPOCH + timedelta(microseconds={v})", "json": "loads({v})"}


def entry_decoder(spec: IndexSpec) -> Callable[[Sequence[Any]], IndexEntry]:
    """What turns a stored row (shard, row_key, ref_key, the fields in declaration order) into an entry.
    A query decodes many rows, so the function is generated for the spec, as namedtuple does: one
    expression per field, no lookups (field names are checked identifiers)."""
    keys = spec.keys
    items = []
    for n, f in enumerate(spec.fields):
        expr = _DECODE_EXPR[f.type].format(v=f"v{n}")
        items.append(f"{f.name!r}: {expr if f.name in keys else f'None if v{n} is None else {expr}'}")
    names = ", ".join(f"v{n}" for n in range(len(spec.fields)))
    source = (f"def decode(row):\n    shard, row_key, ref_key, {names} = row\n"
              f"    return IndexEntry(shard, UUID(bytes=row_key), ref_key, {{{', '.join(items)}}})\n")
    scope: dict[str, Any] = {"IndexEntry": IndexEntry, "UUID": uuid.UUID, "_text": _text, "EPOCH": _EPOCH,
                             "timedelta": dt.timedelta, "loads": json.loads}
    exec(source, scope)  # the source is built from the validated spec only
    decode: Callable[[Sequence[Any]], IndexEntry] = scope["decode"]
    return decode


def check_conditions(spec: IndexSpec, conditions: Sequence[Condition]) -> list[tuple[str, str, Any]]:
    """(field, operator, stored value) of each condition, after checking it names a key."""
    keys = spec.keys
    out = []
    for field, op, value in conditions:
        if field not in keys:
            raise InvalidArgumentError(f"index {spec.name}: {field!r} is not a query key (keys: {', '.join(keys)})")
        if op not in OPERATORS:
            raise InvalidArgumentError(f"index {spec.name}: unknown operator {op!r}")
        out.append((field, op, encode_value(spec.name, spec.field(field), value, True)))
    return out


# -- the apply plan, shared by every backend -------------------------------------------------
Entry = Callable[[IndexChange], tuple[int, list[Any]]]  # a change's entry shard and encoded row


def plan(
    changes: Sequence[IndexChange], locators: Mapping[uuid.UUID, Locator], entry: Entry
) -> tuple[list[EntryWrite], dict[uuid.UUID, tuple[int, Locator]], int]:
    """The entry writes and new locators (with each row's source shard) of ``changes`` applied in order
    over ``locators``, and how many changes were superseded. ``entry`` gives a change's entry shard and
    encoded row (it is not called for a removal). A locator with a negative ref_key is a placeholder (a
    row whose locator is being created) and counts as none. A removal newer than the locator deletes
    the entry where the locator says it is (if any) and locates the row at NO_ENTRY."""
    # Keyed by the row key's int: hashing a UUID goes through Python code, hashing an int does not.
    current = {k.int: v for k, v in locators.items() if v.ref_key >= 0}
    writes: dict[tuple[int, int], EntryWrite] = {}
    updated: dict[uuid.UUID, tuple[int, Locator]] = {}
    superseded = 0
    for change in changes:
        key = change.row_key.int
        found = current.get(key)
        if found is not None and found.ref_key >= change.ref_key:
            superseded += 1
            continue
        if change.values is None:
            if found is not None and found.entry_shard != NO_ENTRY:
                writes[(found.entry_shard, key)] = EntryWrite(found.entry_shard, change.row_key, change.ref_key,
                                                              None)
            current[key] = located = Locator(change.ref_key, NO_ENTRY)
            updated[change.row_key] = (change.shard, located)
            continue
        target, row = entry(change)
        if found is not None and found.entry_shard not in (target, NO_ENTRY):
            writes[(found.entry_shard, key)] = EntryWrite(found.entry_shard, change.row_key, change.ref_key, None)
        writes[(target, key)] = EntryWrite(target, change.row_key, change.ref_key, change.values, row=row)
        current[key] = located = Locator(change.ref_key, target)
        updated[change.row_key] = (change.shard, located)
    # In (shard, row_key) order: two appliers writing the same entries lock them in the same order
    # (a UUID's int orders like its bytes).
    return [writes[k] for k in sorted(writes)], updated, superseded


def repair_plan(fixes: Sequence[Fix], locators: Mapping[uuid.UUID, Locator],
                keep: Callable[[uuid.UUID, Locator], bool]) -> tuple[list[Fix], list[EntryWrite]]:
    """The fixes to make and their forced entry writes. A row whose locator is past the fix's ref_key and
    ``keep`` says reflects a real newer cell changed since verification read it: it is left alone."""
    todo: list[Fix] = []
    writes: list[EntryWrite] = []
    for fix in fixes:
        found = locators.get(fix.row_key)
        if found is not None and found.ref_key > fix.ref_key and keep(fix.row_key, found):
            continue
        todo.append(fix)
        writes.extend(EntryWrite(s, fix.row_key, fix.ref_key, None, True) for s in fix.clear if s != fix.entry_shard)
        if fix.values is not None:
            writes.append(EntryWrite(fix.entry_shard, fix.row_key, fix.ref_key, fix.values, True))
    return todo, sorted(writes, key=lambda w: (w.shard, w.row_key.int))


def unapplied(changes: Sequence[IndexChange], positions: Mapping[int, int]) -> list[IndexChange]:
    """The changes after their shard's recorded position."""
    return [c for c in changes if c.added_id > positions.get(c.shard, -1)]


def new_positions(changes: Sequence[IndexChange]) -> dict[int, int]:
    out: dict[int, int] = {}
    for change in changes:
        if change.added_id > out.get(change.shard, -1):
            out[change.shard] = change.added_id
    return out


Remote = Callable[[list[EntryWrite]], list[EntryWrite]]
S = TypeVar("S")


class StatementCache(Generic[S]):
    """The SQL of each index version, built once by ``build`` (rebuilt if a table gets another spec)."""

    def __init__(self, build: Callable[[IndexSpec], S]) -> None:
        self._build = build
        self._built: dict[str, tuple[IndexSpec, S]] = {}
        self._lock = threading.Lock()

    def __call__(self, spec: IndexSpec) -> S:
        found = self._built.get(spec.table)
        if found is None or found[0] is not spec:
            # Equal specs are often distinct objects (each catalog read makes one): keep the last one
            # seen, so its next calls skip the deep comparison.
            found = (spec, found[1] if found is not None and found[0] == spec else self._build(spec))
            with self._lock:
                self._built[spec.table] = found
        return found[1]


def order_by(spec: IndexSpec, quote: Callable[[str], str]) -> dict[str, str]:
    """The ORDER BY clause of queries, by direction: the keys after the shard field, then row_key."""
    columns = [*(quote(k) for k in spec.keys[1:]), "row_key"]
    return {d: " ORDER BY " + ", ".join(f"{c} {d.upper()}" for c in columns) for d in ("asc", "desc")}


_LISTED = 16  # shard lists longer than this go into a query's text as numbers


def _shard_ranges(shards: Sequence[int]) -> str:
    """``shards`` as a condition: each run of consecutive shards as a BETWEEN (a node's shards are mostly a
    few runs; a long IN list costs MariaDB a join), the shards alone in one IN list."""
    runs: list[list[int]] = []
    for shard in sorted({int(s) for s in shards}):
        if runs and shard == runs[-1][1] + 1:
            runs[-1][1] = shard
        else:
            runs.append([shard, shard])
    alone = [str(a) for a, b in runs if b - a < 2]
    alone += [str(b) for a, b in runs if b - a == 1]
    parts = [f"shard BETWEEN {a} AND {b}" for a, b in runs if b - a >= 2]
    if alone:
        parts.append(f"shard IN ({', '.join(alone)})")
    return f"({' OR '.join(parts)})"


class QueryTexts:
    """The SQL of a query, by shape (shard count, the conditions' fields and operators, order), each built
    once: ``SELECT ... WHERE shard IN (...) AND <conditions> ORDER BY ... LIMIT <mark>``."""

    def __init__(self, select: str, spec: IndexSpec, quote: Callable[[str], str], mark: str) -> None:
        self._select, self._order, self._quote, self._mark = select, order_by(spec, quote), quote, mark
        self._texts: dict[tuple[Any, ...], str] = {}

    def __call__(self, shards: Sequence[int] | None, conditions: Sequence[tuple[str, str, Any]],
                 order: Order) -> tuple[str, list[Any]]:
        """The text and its arguments but the limit (the caller appends it)."""
        if shards is not None and len(shards) > _LISTED:
            # A scatter query's shards of one node (thousands): written as numbers, and not kept, since each
            # shard map gives others.
            where = [_shard_ranges(shards)]
            where.extend(f"{self._quote(f)} {op} {self._mark}" for f, op, _ in conditions)
            return (self._select + " WHERE " + " AND ".join(where) + self._order[order] + f" LIMIT {self._mark}",
                    [value for _, _, value in conditions])
        shape = (None if shards is None else len(shards), tuple((f, op) for f, op, _ in conditions), order)
        text = self._texts.get(shape)
        if text is None:
            where = [] if shards is None else [f"shard IN ({', '.join([self._mark] * len(shards))})"]
            where.extend(f"{self._quote(f)} {op} {self._mark}" for f, op, _ in conditions)
            text = (self._select + (" WHERE " + " AND ".join(where) if where else "") + self._order[order]
                    + f" LIMIT {self._mark}")
            self._texts[shape] = text
        return text, [*(shards or ()), *(value for _, _, value in conditions)]


class IndexRecorder(ABC):
    """One storage node's part of the index tables. Safe to share between threads."""

    name: str  # the storage node's

    @abstractmethod
    def create(self, spec: IndexSpec) -> None:
        """Create the version's tables if missing; ConfigurationError if the node has another spec for them."""

    @abstractmethod
    def drop(self, spec: IndexSpec) -> None:
        """Drop the version's tables and positions (missing ones are fine)."""

    @abstractmethod
    def specs(self) -> list[IndexSpec]:
        """Every index version the node holds."""

    @abstractmethod
    def apply(self, spec: IndexSpec, stream: Stream | None, changes: Sequence[IndexChange],
              positions: Mapping[int, int], entry: Entry, remote: Remote) -> ApplyResult:
        """Apply changes of source shards held by this node in one transaction (see the module docstring),
        recording the stream's new ``positions`` (shard: location) in it; with no stream, no position is
        read or written. ``remote`` writes what belongs to other nodes and returns this node's share."""

    @abstractmethod
    def repair(self, spec: IndexSpec, fixes: Sequence[Fix], keep: Callable[[uuid.UUID, Locator], bool],
               remote: Remote) -> int:
        """Make fixes of rows of this node's shards in one transaction that locks their locators first
        (see :func:`repair_plan`); sets or deletes the locators; returns the rows fixed."""

    @abstractmethod
    def write_entries(self, spec: IndexSpec, writes: Sequence[EntryWrite]) -> None:
        """Another node's apply: these entry writes, in one transaction of this node."""

    @abstractmethod
    def query(self, spec: IndexSpec, shards: Sequence[int] | None, conditions: Sequence[tuple[str, str, Any]],
              order: Order, limit: int) -> list[IndexEntry]:
        """Entries of ``shards`` (all of the node's when None) matching every condition, ordered by the keys
        after the shard field, then row_key."""

    @abstractmethod
    def positions(self, spec: IndexSpec, stream: Stream) -> dict[int, IndexPosition]:
        """The stream's recorded position in each source shard of this node that has one."""

    @abstractmethod
    def set_targets(self, spec: IndexSpec, stream: Stream, targets: Mapping[int, int]) -> None:
        """Record where the stream ends in each shard (a backfill's heads), creating positions at 0."""

    @abstractmethod
    def scan(self, spec: IndexSpec, shard: int, after: uuid.UUID | None, limit: int) -> list[IndexEntry]:
        """The entries of one shard in row_key order, after ``after``: verification reads them all."""

    @abstractmethod
    def locators(self, spec: IndexSpec, row_keys: Sequence[uuid.UUID]) -> dict[uuid.UUID, Locator]:
        """The locators of these rows (of this node's shards) that exist."""

    # -- shards that moved: only backends whose nodes move shards override these ------------------
    def strays(self, spec: IndexSpec, held: Collection[int]) -> list[StrayRows]:
        """The version's rows in shards outside ``held`` (the shards the map gives this node), by shard."""
        return []

    def drop_shard(self, spec: IndexSpec, shard: int, pace: Callable[[int], None] | None = None,
                   chunk: int = 2000) -> int:
        """Delete the version's rows in ``shard`` (a shard this node does not hold) in chunks of ``chunk`` rows,
        calling ``pace`` with each chunk's rows before deleting it; returns the rows deleted."""
        return 0
