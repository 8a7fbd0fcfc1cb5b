"""Dead-letter triage: list, stats, show, replay and discard an app's entries (``app.dlq``, ``cellstream dlq``,
the console), with filters; the entries are kept by :mod:`indexer.runtime.dlq_store`.

Replay runs the app's current handler on the entry's cell through the normal path
(the same retries). The entry is marked ``replayed`` before the handler runs and
``resolved`` or ``open`` (with the new attempts) after, each a durable version, so a
replay is idempotent (a resolved or discarded entry is left alone) and resumable (an
interrupted ``replay --match`` picks up the entries still open or replayed).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from pydantic import AwareDatetime, BaseModel, ConfigDict, ValidationError

from indexer.errors import EntryStateError, HandlerMissingError, InvalidFilterError
from indexer.runtime.dlq_store import OPEN_STATES, DeadLetter, DeadLetterStore, Status
from indexer.runtime.handlers import Processor
from indexer.runtime.policy import Outcome, describe
from logstore import Cell, CellConflictError, LogstoreError

logger = logging.getLogger(__name__)
POLICY_ACTOR = "policy"  # who a redrive policy's replays are recorded as
_List = list  # DeadLetterQueue.list shadows the builtin inside the class


class Matchable(Protocol):
    """What a filter looks at: a :class:`DeadLetter`, or a lighter summary of one (the console's)."""

    @property
    def handler(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def error_type(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def last_failure(self) -> dt.datetime: ...


class DLQFilter(BaseModel):
    """Which entries: every given field must match (``error`` is a case-insensitive part of the class name,
    ``text`` a case-insensitive part of the message)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    handler: str | None = None
    status: Status | None = None
    error: str | None = None
    fingerprint: str | None = None
    text: str | None = None
    since: AwareDatetime | None = None  # last failure at or after
    until: AwareDatetime | None = None  # last failure before

    @classmethod
    def parse(cls, text: str) -> DLQFilter:
        """``handler=bill_rider,status=open error=Declined``: fields separated by commas or spaces."""
        fields: dict[str, str] = {}
        for part in text.replace(",", " ").split():
            name, sep, value = part.partition("=")
            if not sep or not value:
                raise InvalidFilterError(f"filter part {part!r} is not field=value")
            fields[name] = value
        return cls.build(**fields)

    @classmethod
    def build(cls, **fields: Any) -> DLQFilter:
        try:
            return cls(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"])) or "filter"
            raise InvalidFilterError(f"filter {where}: {first['msg']}") from None

    def matches(self, entry: Matchable) -> bool:
        return ((self.handler is None or entry.handler == self.handler)
                and (self.status is None or entry.status == self.status)
                and (self.error is None or self.error.lower() in entry.error_type.lower())
                and (self.fingerprint is None or entry.fingerprint == self.fingerprint)
                and (self.text is None or self.text.lower() in entry.message.lower())
                and (self.since is None or entry.last_failure >= self.since)
                and (self.until is None or entry.last_failure < self.until))


class ReplayResult(NamedTuple):
    id: str
    handler: str
    before: str  # status before the replay
    after: str  # status after it ("would replay" in a dry run)
    attempts: int
    error: str | None = None


class DeadLetterQueue:
    """The dead letters of one app. ``processor`` gives the app's handlers, for replays."""

    def __init__(self, deadletters: DeadLetterStore, processor: Callable[[], Processor]) -> None:
        self.deadletters = deadletters
        self._processor = processor

    @property
    def app(self) -> str:
        return self.deadletters.app

    def handlers(self) -> _List[str]:
        """The names of the app's handlers: what a replay can run."""
        return [t.name for t in self._processor().triggers]

    def list(self, match: DLQFilter | None = None, **filters: Any) -> _List[DeadLetter]:
        """Entries (latest versions) matching ``match`` or the filter fields, oldest first."""
        wanted = match or DLQFilter.build(**filters)
        return [e for e in self.deadletters.entries() if wanted.matches(e)]

    def show(self, entry_id: str) -> DeadLetter:
        return self.deadletters.get(entry_id)

    def stats(self, match: DLQFilter | None = None, **filters: Any) -> _List[dict[str, Any]]:
        """Entries grouped by handler and error fingerprint, largest group first."""
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        for entry in self.list(match, **filters):
            group = groups.setdefault((entry.handler, entry.fingerprint), {
                "handler": entry.handler, "fingerprint": entry.fingerprint, "error_type": entry.error_type,
                "example": entry.message[:200], "count": 0, "open": 0, "by_status": {},
                "first_seen": entry.first_failure, "last_seen": entry.last_failure})
            group["count"] += 1
            group["open"] += entry.status in OPEN_STATES
            group["by_status"][entry.status] = group["by_status"].get(entry.status, 0) + 1
            group["first_seen"] = min(group["first_seen"], entry.first_failure)
            group["last_seen"] = max(group["last_seen"], entry.last_failure)
        out = sorted(groups.values(), key=lambda g: (-g["count"], g["handler"], g["fingerprint"]))
        for group in out:
            group["first_seen"], group["last_seen"] = group["first_seen"].isoformat(), group["last_seen"].isoformat()
        return out

    def discard(self, entry_id: str, reason: str, *, actor: str | None = None) -> DeadLetter:
        """Close an open entry without processing it; ``reason`` (and ``actor``) kept in its history."""
        if not reason or not reason.strip():
            raise InvalidFilterError("discard needs a reason")
        entry = self.deadletters.get(entry_id)
        if entry.status == "discarded":
            return entry
        if entry.status not in OPEN_STATES:
            raise EntryStateError(f"dead letter {entry_id} is {entry.status}; only open entries can be discarded")
        try:
            changed = self.deadletters.change(entry, "discarded", note=reason.strip(), actor=actor)
        except CellConflictError:
            raise EntryStateError(f"dead letter {entry_id} was changed by another process; look again") from None
        self._processor().entry_closed(entry.handler)
        return changed

    def discard_matching(self, match: DLQFilter, reason: str, *, dry_run: bool = False,
                         actor: str | None = None) -> _List[DeadLetter]:
        """Discard every open entry ``match`` matches (with ``dry_run``, only list them); the entries as they
        are after (or would be). An entry another process changed meanwhile is left as it is, not discarded."""
        if not reason or not reason.strip():
            raise InvalidFilterError("discard needs a reason")
        entries = [e for e in self.list(match) if e.status in OPEN_STATES]
        if dry_run:
            return entries
        done = []
        for entry in entries:
            try:
                done.append(self.discard(entry.id, reason, actor=actor))
            except EntryStateError as exc:
                logger.warning("dead letter %s not discarded: %s", entry.id, exc)
        return done

    # -- replay -----------------------------------------------------------------
    def replay(self, entry_id: str | None = None, *, match: DLQFilter | None = None,
               dry_run: bool = False, actor: str | None = None) -> _List[ReplayResult]:
        """Replay one entry, or every open (or interrupted) entry matching ``match``. Blocking."""
        return asyncio.run(self.replay_async(entry_id, match=match, dry_run=dry_run, actor=actor))

    async def replay_async(self, entry_id: str | None = None, *, match: DLQFilter | None = None,
                           dry_run: bool = False, actor: str | None = None) -> _List[ReplayResult]:
        if (entry_id is None) == (match is None):
            raise InvalidFilterError("replay needs either an entry id or a filter (--match), not both")
        if entry_id is not None:
            entries = [await asyncio.to_thread(self.deadletters.get, entry_id)]
        else:
            assert match is not None
            entries = [e for e in await asyncio.to_thread(self.list, match) if e.status in OPEN_STATES]
        results = []
        for entry in entries:
            if entry.status not in OPEN_STATES:
                results.append(ReplayResult(entry.id, entry.handler, entry.status, entry.status, 0))
            elif dry_run:
                results.append(ReplayResult(entry.id, entry.handler, entry.status, "would replay", 0))
            else:
                results.append(await self._replay_one(entry, actor))
        return results

    async def redrive_async(self, entry: DeadLetter, note: str) -> ReplayResult:
        """One redrive by a redrive policy (:mod:`indexer.runtime.redrive`): the replay of ``entry`` as
        :meth:`replay_async` makes it, by the actor ``policy``, counted in the entry's ``redrives``.

        Args:
            entry: the entry as last read; if another process changed it since, nothing runs.
            note: what the history says of the redrive's start (e.g. ``redrive 2 of 3``).

        Returns:
            The result: ``after`` is ``resolved``, ``open`` (failed again, with the error), the status of an
            entry that is not open, or ``changed by another process``.

        Raises:
            HandlerMissingError: the app no longer has the entry's handler.
        """
        if entry.status not in OPEN_STATES:
            return ReplayResult(entry.id, entry.handler, entry.status, entry.status, 0)
        return await self._replay_one(entry, POLICY_ACTOR, redrive=note)

    async def _replay_one(self, entry: DeadLetter, actor: str | None, redrive: str | None = None) -> ReplayResult:
        processor = self._processor()
        trigger = next((t for t in processor.triggers if t.name == entry.handler), None)
        if trigger is None:
            raise HandlerMissingError(f"app {self.app} has no handler {entry.handler} to replay {entry.id} with")
        before = entry.status
        what = "replay" if redrive is None else "redrive"
        try:
            entry = await asyncio.to_thread(self.deadletters.change, entry, "replayed",
                                          note=redrive or "replay started", actor=actor,
                                          redrive=redrive is not None)
            try:
                cell = await asyncio.to_thread(self._cell_of, entry)
            except LogstoreError as exc:  # still undecodable, or the store is down: one more failed attempt
                now = self.deadletters.clock.now()
                outcome = Outcome(False, 1, describe(exc), now, now)
            else:
                outcome = await processor.run(trigger, cell)
            if outcome.ok:
                await asyncio.to_thread(self.deadletters.change, entry, "resolved", note=f"{what} succeeded",
                                        outcome=outcome, actor=actor)
                processor.entry_closed(entry.handler)
                return ReplayResult(entry.id, entry.handler, before, "resolved", outcome.attempts)
            await asyncio.to_thread(self.deadletters.change, entry, "open", note=f"{what} failed", outcome=outcome,
                                    actor=actor)
        except CellConflictError:
            return ReplayResult(entry.id, entry.handler, before, "changed by another process", 0)
        assert outcome.failure is not None
        return ReplayResult(entry.id, entry.handler, before, "open", outcome.attempts,
                            f"{outcome.failure.error_type}: {outcome.failure.message}")

    def _cell_of(self, entry: DeadLetter) -> Cell:
        where = entry.cell
        if any(where.get(name) in (None, "") for name in ("row_key", "column", "ref_key")):
            raise LogstoreError(f"entry {entry.id} names no cell (a message no tailer wrote, at {entry.source}); "
                                "there is nothing to replay: discard it")
        if entry.body is not None:
            return Cell(uuid.UUID(where["row_key"]), where["column"], int(where["ref_key"]), entry.body,
                        int(where.get("added_id") or 0), int(where.get("shard") or 0),
                        dt.datetime.fromisoformat(where["created_at"]) if where.get("created_at") else
                        entry.first_failure)
        cell = self.deadletters.store.get_cell(where["row_key"], where["column"], int(where["ref_key"]))
        if cell is None:
            raise LogstoreError(f"the cell {where['row_key']}/{where['column']}/{where['ref_key']} is not in the store")
        return cell
