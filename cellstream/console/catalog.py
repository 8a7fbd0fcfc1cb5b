"""What the console shows: a summary of every dead letter of its apps, followed incrementally.

An app's entries are versions of cells in one shard's log (:mod:`indexer.runtime.dlq_store`), so the
catalog reads each app's DLQ shard once from the start and afterwards only the cells added since (the
store's paging never skips a committed cell). Filters, paging, the overview's groups and its chart then
run over summaries in memory: a page of 100,000 entries costs a filter over a list, not a read of the
shard. Bodies and tracebacks stay in the store; the entry page reads the one it shows.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from indexer.runtime.dlq_store import DLQ_COLUMN, OPEN_STATES, STATUSES, DeadLetterStore
from indexer.runtime.dlq_triage import DLQFilter
from logstore import TruncatedPage

_PAGE = 5000
_CACHED_QUERIES = 16


@dataclass(slots=True, frozen=True)
class Summary:
    """The fields the list, the filters and the overview need; what the entry page adds is in the store."""

    app: str
    id: str
    version: int
    handler: str
    status: str
    error_type: str
    fingerprint: str
    message: str
    attempts: int
    first_failure: dt.datetime
    last_failure: dt.datetime
    row_key: str | None
    column: str

    @classmethod
    def of(cls, app: str, version: int, body: Mapping[str, Any]) -> Summary:
        cell = body.get("cell") or {}
        return cls(app, str(body["id"]), version, str(body["handler"]), str(body.get("status", "open")),
                   str(body["error_type"]), str(body["fingerprint"]), str(body["message"])[:500],
                   int(body["attempts"]), _when(body["first_failure"]), _when(body["last_failure"]),
                   cell.get("row_key"), str(body.get("column", "")))


def _when(value: Any) -> dt.datetime:
    when = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


class Query(NamedTuple):
    """A filter as the list page takes it: the app (None: every app) and the DLQ filter's fields."""

    app: str | None
    match: DLQFilter


class Group(NamedTuple):
    app: str
    handler: str
    fingerprint: str
    error_type: str
    example: str
    open: int
    first_seen: dt.datetime
    last_seen: dt.datetime


class Bucket(NamedTuple):
    start: dt.datetime
    entries: int


class EntryCatalog:
    """Summaries of the dead letters of several apps (``{app name: its DeadLetterStore}``).

    :meth:`refresh` (blocking: run it in a thread) reads what was added to the DLQ shards since the
    last call; readers get consistent snapshots from any thread.
    """

    def __init__(self, sources: Mapping[str, DeadLetterStore]) -> None:
        self.sources = dict(sources)
        self._locations = dict.fromkeys(self.sources, 0)
        self._entries: dict[tuple[str, str], Summary] = {}
        self._ordered: list[Summary] = []  # newest last failure first
        self._generation = 0
        self._queries: OrderedDict[tuple[Query, int], list[Summary]] = OrderedDict()
        self._groups: tuple[int, list[Group]] = (-1, [])  # (generation, the groups of that generation)
        self._refresh_lock = threading.Lock()
        self._query_lock = threading.Lock()

    @property
    def apps(self) -> list[str]:
        return sorted(self.sources)

    def refresh(self) -> int:
        """Read the cells added to every app's DLQ shard since the last refresh; the entries that changed."""
        with self._refresh_lock:
            changed: dict[tuple[str, str], Summary] = {}
            for app, source in self.sources.items():
                location = self._locations[app]
                while True:
                    page, location = source.store.get_cells_for_shard(source.shard, location, _PAGE,
                                                                      columns=[DLQ_COLUMN])
                    for cell in page:
                        if cell.body.get("app") != app:
                            continue  # another app's entries share the shard
                        key = (app, str(cell.row_key))
                        known = changed.get(key) or self._entries.get(key)
                        if known is None or cell.ref_key > known.version:
                            changed[key] = Summary.of(app, cell.ref_key, cell.body)
                    if len(page) < _PAGE and not isinstance(page, TruncatedPage):
                        break
                self._locations[app] = location
            if changed:
                entries = {**self._entries, **changed}
                ordered = sorted(entries.values(), key=lambda e: (e.last_failure, e.id), reverse=True)
                # One assignment each: a reader on another thread sees the old lists or the new ones.
                self._entries, self._ordered = entries, ordered
                self._generation += 1
            return len(changed)

    def snapshot(self) -> list[Summary]:
        """Every entry, newest last failure first (do not change the list)."""
        return self._ordered

    def get(self, app: str, entry_id: str) -> Summary | None:
        return self._entries.get((app, entry_id))

    def __len__(self) -> int:
        return len(self._entries)

    def query(self, query: Query) -> list[Summary]:
        """The entries ``query`` matches, newest last failure first (the last few answers are kept: paging
        through one filter filters once)."""
        generation, ordered = self._generation, self._ordered
        key = (query, generation)
        with self._query_lock:
            found = self._queries.get(key)
            if found is not None:
                self._queries.move_to_end(key)
                return found
        match, app = query.match, query.app
        found = [e for e in ordered if (app is None or e.app == app) and match.matches(e)]
        with self._query_lock:
            self._queries[key] = found
            while len(self._queries) > _CACHED_QUERIES:
                self._queries.popitem(last=False)
        return found

    def counts(self) -> dict[str, int]:
        """Entries per status, over every app."""
        out = dict.fromkeys(STATUSES, 0)
        for entry in self._ordered:
            out[entry.status] = out.get(entry.status, 0) + 1
        return out

    def groups(self) -> list[Group]:
        """Open (and interrupted) entries per app, handler and error fingerprint, largest group first
        (computed once per change of the entries: the overview asks at every load)."""
        generation, ordered = self._generation, self._ordered
        if self._groups[0] == generation:
            return self._groups[1]
        found: dict[tuple[str, str, str], Group] = {}
        for e in ordered:
            if e.status not in OPEN_STATES:
                continue
            key = (e.app, e.handler, e.fingerprint)
            g = found.get(key)
            if g is None:
                found[key] = Group(e.app, e.handler, e.fingerprint, e.error_type, e.message[:200], 1,
                                   e.first_failure, e.last_failure)
            else:
                found[key] = g._replace(open=g.open + 1, first_seen=min(g.first_seen, e.first_failure),
                                        last_seen=max(g.last_seen, e.last_failure))
        groups = sorted(found.values(), key=lambda g: (-g.open, g.app, g.handler, g.fingerprint))
        self._groups = (generation, groups)
        return groups


def timeline(entries: Sequence[Summary], now: dt.datetime, buckets: int = 48) -> tuple[dt.timedelta, list[Bucket]]:
    """Entries dead-lettered (first failure) per interval, over the span from the first one to ``now``:
    the interval is the smallest of a minute, 10 minutes, an hour, 6 hours or a day that fits in
    ``buckets`` intervals, so the chart reads in round units."""
    if not entries:
        return dt.timedelta(hours=1), []
    first = min(e.first_failure for e in entries)
    span = max(now - first, dt.timedelta(minutes=1))
    steps = [dt.timedelta(minutes=m) for m in (1, 10, 60, 360, 1440)]
    step = next((s for s in steps if span / s <= buckets), dt.timedelta(days=-(-span.days // buckets) or 1))
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    start = epoch + step * ((now - epoch) // step) - step * (buckets - 1)
    counts = [0] * buckets
    for e in entries:
        index = (e.first_failure - start) // step
        if 0 <= index < buckets:
            counts[index] += 1
        elif index < 0:
            counts[0] += 1  # the first bar starts on a whole interval, up to one after the first entry
    return step, [Bucket(start + step * i, n) for i, n in enumerate(counts)]
