"""Scheduled redrive: an app hands its dead letters back to their handler by a *redrive policy*.

>>> app = App("billing", store=..., redrive={"delay": 300, "multiplier": 2, "max_redrives": 3,
...                                          "errors": ["CardDeclined"]})     # doctest: +SKIP

The policy says after how long (``delay`` after the entry's last failure, times ``multiplier`` for each
redrive made already, at most ``max_delay``), how many times at most (``max_redrives``) and which entries
(``handlers``, ``errors`` by class name, ``retriable``, a ``pattern`` of the message). The app runs it itself
while it serves (:class:`Redriver`, a task of the runtime in direct and Kafka mode alike): every ``interval``
seconds it reads its open entries and redrives the due ones through
:meth:`DeadLetterQueue.redrive_async <indexer.runtime.dlq_triage.DeadLetterQueue.redrive_async>`, the path of
``cellstream dlq replay``, as the actor ``policy``. The count of redrives is the entry's (``redrives``), so a
restarted app goes on counting, and each redrive is two events of the entry's history (its start, its outcome).

The policy *in force* lives in the store (:class:`PolicyStore`: a system cell in the app's DLQ shard, one
version per change): seeded from the app's declaration when it starts, changed by an operator (``cellstream
dlq policy set``, the console), whose change wins over the declaration until ``policy reset``. Each check
reads it, so a change takes effect within ``interval`` seconds in every process of the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import re
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from indexer.errors import HandlerMissingError, InvalidPolicyError
from indexer.runtime.clock import Clock
from indexer.runtime.dlq_store import DLQ_COLUMN, DeadLetter, DeadLetterStore
from indexer.runtime.dlq_triage import DeadLetterQueue
from indexer.runtime.metrics import AppMetrics
from logstore import CellConflictError, TruncatedPage
from logstore.cell import key_in_shard

logger = logging.getLogger(__name__)
POLICY_COLUMN = "_dlq_policy"
DECLARED_ACTOR = "app"  # who a seeding from the app's code or connector file is recorded as
_NAMESPACE = uuid.UUID("0c9b7a52-3f0e-4d6b-8a4e-2b1f7d5e9c31")
_PAGE = 1000
_WRITE_TRIES = 8
_MAX_SECONDS = 30 * 86400.0


class RedrivePolicy(BaseModel):
    """When and which of an app's open dead letters the app hands back to their handler by itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="False keeps the policy but redrives nothing")
    delay: float = Field(gt=0, le=_MAX_SECONDS, description="seconds after an entry's last failure before its "
                                                              "first redrive")
    multiplier: float = Field(1.0, ge=1, le=100, description="each later redrive waits this many times longer "
                                                              "than the one before")
    max_delay: float | None = Field(None, gt=0, le=_MAX_SECONDS, description="the longest wait between redrives")
    max_redrives: int = Field(3, ge=1, le=1000, description="redrives of one entry at most; then it waits for "
                                                            "a person")
    handlers: tuple[str, ...] = Field((), description="only these handlers' entries (empty: every handler)")
    errors: tuple[str, ...] = Field((), description="only entries whose error class is one of these: a class name "
                                                    "(CardDeclined) or a qualified one (billing.CardDeclined); "
                                                    "empty: any error")
    retriable: bool | None = Field(None, description="only entries whose error said a retry may help (True) or "
                                                     "said it cannot (False); None: either")
    pattern: str | None = Field(None, max_length=500, description="only entries whose error message this regular "
                                                                  "expression is found in")
    interval: float = Field(5.0, gt=0, le=3600, description="seconds between the app's looks for due entries")
    batch: int = Field(100, ge=1, le=10_000, description="redrives at most per look, the longest-due first")

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @field_validator("handlers", "errors")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(name.strip() for name in value)
        if any(not name for name in names):
            raise ValueError("a name is empty")
        return names

    @classmethod
    def parse(cls, value: RedrivePolicy | Mapping[str, Any]) -> RedrivePolicy:
        """The policy from its fields (a dict, e.g. an app's ``redrive=`` or a connector file's ``redrive:``).

        Raises:
            InvalidPolicyError: a field is unknown or has a bad value (named in the message).
        """
        if isinstance(value, RedrivePolicy):
            return value
        if not isinstance(value, Mapping):
            raise InvalidPolicyError(f"a redrive policy is a mapping of its fields, got {type(value).__name__}")
        try:
            return cls.model_validate(dict(value))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"])) or "policy"
            raise InvalidPolicyError(f"redrive policy {where}: {first['msg']}") from None

    def updated(self, assignments: Sequence[str]) -> RedrivePolicy:
        """This policy with ``field=value`` assignments applied (``cellstream dlq policy set``): a value is read
        as JSON when it is JSON (``60``, ``true``, ``null``), else as text; ``handlers`` and ``errors`` take a
        comma-separated list.

        Raises:
            InvalidPolicyError: an assignment is not ``field=value``, or the result is not a valid policy.
        """
        return RedrivePolicy.parse({**self.model_dump(), **parse_assignments(assignments)})

    def matches(self, entry: DeadLetter) -> bool:
        """Whether the policy redrives ``entry`` at all (its handler and error), whatever its count and time."""
        if self.handlers and entry.handler not in self.handlers:
            return False
        if self.errors and not any(entry.error_type == name or entry.error_type.endswith(f".{name}")
                                   for name in self.errors):
            return False
        if self.retriable is not None and entry.retriable is not self.retriable:
            return False  # an entry recorded before `retriable` was kept is unknown: never taken for either
        return self.pattern is None or re.search(self.pattern, entry.message) is not None

    def wait(self, redrives: int) -> float:
        """Seconds after the last failure before redrive number ``redrives + 1``."""
        seconds = self.delay * self.multiplier ** min(redrives, 1000)
        return min(seconds, self.max_delay) if self.max_delay is not None else min(seconds, _MAX_SECONDS)

    def due_at(self, entry: DeadLetter) -> dt.datetime | None:
        """When the policy redrives ``entry`` next; None when it never does (not matched, or no redrive left)."""
        if entry.status != "open" or not self.matches(entry) or entry.redrives >= self.max_redrives:
            return None
        return entry.last_failure + dt.timedelta(seconds=self.wait(entry.redrives))


def parse_assignments(assignments: Sequence[str]) -> dict[str, Any]:
    """``["delay=60", "errors=CardDeclined,Timeout"]`` as policy fields (see :meth:`RedrivePolicy.updated`).

    Raises:
        InvalidPolicyError: an assignment is not ``field=value``.
    """
    fields: dict[str, Any] = {}
    for text in assignments:
        name, sep, raw = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InvalidPolicyError(f"{text!r} is not field=value (e.g. delay=300 max_redrives=3)")
        value: Any
        if name in ("handlers", "errors"):
            value = [part.strip() for part in raw.split(",") if part.strip()]
        else:
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        fields[name] = value
    return fields


class PolicyRecord(BaseModel):
    """One version of an app's policy cell: the policy in force, and the app's own declaration beside it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    app: str
    policy: RedrivePolicy | None = Field(description="the policy in force (None: the app redrives nothing)")
    declared: RedrivePolicy | None = Field(description="as the app's code or connector file last declared it")
    origin: Literal["declared", "operator"] = Field(description="declared: the declaration is in force; "
                                                                "operator: a person's change is, until a reset")
    actor: str = Field(description="who made this version: `app` (seeded at start), `cli:<user>`, `console:<name>`")
    at: dt.datetime
    note: str | None = None
    version: int = Field(0, description="the ref_key of the cell holding this version (not in the body)")


class PolicyStore:
    """The redrive policy in force of one app: a system cell (column ``_dlq_policy``) in the app's DLQ shard,
    a version per change, written compare-and-set (two processes seeding at once write one version)."""

    def __init__(self, deadletters: DeadLetterStore) -> None:
        self.store = deadletters.store
        self.app = deadletters.app
        self.clock = deadletters.clock
        self.shard = deadletters.shard
        self.key = key_in_shard(_NAMESPACE, f"redrive-policy\x00{self.app}", self.shard, self.store.shard_count)

    def get(self) -> PolicyRecord | None:
        """(blocking) The latest version; None when the app never had a policy."""
        found = self.store.get_cell_latest(self.key, POLICY_COLUMN)
        if found is None:
            return None
        return PolicyRecord.model_validate({**found.body, "version": found.ref_key})

    def history(self) -> list[PolicyRecord]:
        """(blocking) Every version, oldest first: who changed the policy, when, to what."""
        out: list[PolicyRecord] = []
        location = 0
        while True:
            page, location = self.store.get_cells_for_shard(self.shard, location, _PAGE, columns=[POLICY_COLUMN])
            out += [PolicyRecord.model_validate({**c.body, "version": c.ref_key}) for c in page
                    if c.row_key == self.key and c.body.get("app") == self.app]
            if len(page) < _PAGE and not isinstance(page, TruncatedPage):
                break
        return sorted(out, key=lambda r: r.version)

    def seed(self, declared: RedrivePolicy | None) -> PolicyRecord | None:
        """(blocking) Record the app's declaration at its start. The first one is put in force; a later, different
        one too, unless an operator's change is in force (it wins until :meth:`reset`): then it is only kept
        beside it. Returns the version in force (None: no policy, none declared)."""
        for _ in range(_WRITE_TRIES):
            current = self.get()
            if current is None and declared is None:
                return None
            if current is not None and current.declared == declared:
                return current
            operator = current is not None and current.origin == "operator"
            record = PolicyRecord(
                app=self.app, policy=current.policy if operator and current else declared, declared=declared,
                origin="operator" if operator else "declared", actor=DECLARED_ACTOR, at=self.clock.now(),
                note="declaration changed; the operator's policy stays in force" if operator else
                "declared by the app")
            if operator:
                logger.warning("app %s: its redrive policy declaration changed, but an operator's policy (%s) is "
                               "in force; `cellstream dlq policy reset` puts the declaration in force", self.app,
                               current.actor if current else "?")
            try:
                return self._write(record, (current.version if current else 0) + 1)
            except CellConflictError:
                continue  # another process of the app seeded (or an operator changed) it meanwhile
        raise InvalidPolicyError(f"app {self.app}: the redrive policy keeps changing under this process")

    def set(self, policy: RedrivePolicy | None, actor: str, note: str | None = None) -> PolicyRecord:
        """(blocking) An operator's policy, in force from the app's next check (``None``: no redrive at all).

        Raises:
            CellConflictError: another change was written between this one's read and write (look again).
        """
        current = self.get()
        record = PolicyRecord(app=self.app, policy=policy, declared=current.declared if current else None,
                              origin="operator", actor=actor, at=self.clock.now(), note=note)
        return self._write(record, (current.version if current else 0) + 1)

    def reset(self, actor: str) -> PolicyRecord | None:
        """(blocking) Put the app's declaration back in force (as last seeded); None when there is no policy."""
        current = self.get()
        if current is None:
            return None
        record = PolicyRecord(app=self.app, policy=current.declared, declared=current.declared, origin="declared",
                              actor=actor, at=self.clock.now(), note="reset to the app's declaration")
        return self._write(record, current.version + 1)

    def _write(self, record: PolicyRecord, version: int) -> PolicyRecord:
        body = record.model_dump(mode="json", exclude={"version"})
        self.store.put_system_cells([(self.key, POLICY_COLUMN, version, body)])
        return record.model_copy(update={"version": version})


class _OpenEntries:
    """The open entries of one app, followed through its DLQ shard from where the last read ended (one query
    that finds the versions written since, mostly none), as :class:`~indexer.runtime.dlq_store.OpenCounts`."""

    def __init__(self, deadletters: DeadLetterStore) -> None:
        self._deadletters = deadletters
        self._location = 0
        self._latest: dict[str, int] = {}  # entry id -> its latest version seen
        self._open: dict[str, DeadLetter] = {}
        self._lock = threading.Lock()

    def read(self) -> list[DeadLetter]:
        with self._lock:
            store, app = self._deadletters.store, self._deadletters.app
            while True:
                page, self._location = store.get_cells_for_shard(self._deadletters.shard, self._location, _PAGE,
                                                                 columns=[DLQ_COLUMN])
                for cell in page:
                    key = str(cell.row_key)
                    if cell.body.get("app") != app or cell.ref_key <= self._latest.get(key, 0):
                        continue
                    self._latest[key] = cell.ref_key
                    if cell.body.get("status") == "open":
                        self._open[key] = DeadLetter.model_validate({**cell.body, "version": cell.ref_key})
                    else:
                        self._open.pop(key, None)
                if len(page) < _PAGE and not isinstance(page, TruncatedPage):
                    break
            return list(self._open.values())


class Redriver:
    """The redrive policy of one app process at work while the app serves (:meth:`run`)."""

    def __init__(self, dlq: DeadLetterQueue, metrics: AppMetrics, clock: Clock, handlers: Sequence[str],
                 idle_interval: float) -> None:
        """Args:
            dlq: the app's dead letters (the redrives go through its replay path).
            metrics: the app's metrics: redrives by outcome, entries waiting and exhausted.
            clock: the app's clock: when an entry is due.
            handlers: the app's handlers (their gauges start at 0).
            idle_interval: seconds between looks at the policy while there is none (or it is disabled)."""
        self.dlq = dlq
        self.policies = PolicyStore(dlq.deadletters)
        self.metrics = metrics
        self.clock = clock
        self.handlers = list(handlers)
        self.idle_interval = idle_interval
        self._entries = _OpenEntries(dlq.deadletters)
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Check now, then every policy ``interval`` seconds, until :meth:`stop`; a redrive under way finishes
        first (a cancelled one would leave its entry ``replayed``). A failed check is logged and retried."""
        while not self._stopping.is_set():
            try:
                interval = await self.check()
            except Exception as exc:  # the store is down: look again later
                logger.warning("app %s: dead letters not redriven: %s: %s", self.dlq.app, type(exc).__name__, exc)
                interval = self.idle_interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)

    def stop(self) -> None:
        self._stopping.set()

    async def check(self) -> float:
        """Redrive the entries due now under the policy in force; set the gauges. Returns the seconds until the
        next check."""
        record = await asyncio.to_thread(self.policies.get)
        policy = record.policy if record is not None else None
        if policy is None or not policy.enabled:
            self._gauges({}, {})
            return self.idle_interval
        entries = await asyncio.to_thread(self._entries.read)
        now = self.clock.now()
        waiting: dict[str, int] = {}
        exhausted: dict[str, int] = {}
        due: list[tuple[dt.datetime, DeadLetter]] = []
        for entry in entries:
            when = policy.due_at(entry)
            if when is None:
                if policy.matches(entry):
                    exhausted[entry.handler] = exhausted.get(entry.handler, 0) + 1
                continue
            waiting[entry.handler] = waiting.get(entry.handler, 0) + 1
            if when <= now:
                due.append((when, entry))
        due.sort(key=lambda item: (item[0], item[1].id))
        for _when, entry in due[:policy.batch]:
            if self._stopping.is_set():
                break
            outcome = await self._redrive(entry, policy)
            if outcome != "failed":
                waiting[entry.handler] -= 1  # resolved, or someone else's now: counted again next time
            elif entry.redrives + 1 >= policy.max_redrives:
                waiting[entry.handler] -= 1
                exhausted[entry.handler] = exhausted.get(entry.handler, 0) + 1
        self._gauges(waiting, exhausted)
        return policy.interval

    async def _redrive(self, entry: DeadLetter, policy: RedrivePolicy) -> str:
        note = f"redrive {entry.redrives + 1} of {policy.max_redrives} by the redrive policy"
        try:
            result = await self.dlq.redrive_async(entry, note)
        except HandlerMissingError as exc:
            logger.warning("app %s: %s", self.dlq.app, exc)
            outcome = "error"
        else:
            outcome = {"resolved": "resolved", "open": "failed"}.get(result.after, "skipped")
            log = logger.info if outcome != "failed" else logger.warning
            log("app %s: dead letter %s (%s) redriven (%d of %d): %s%s", self.dlq.app, entry.id, entry.handler,
                entry.redrives + 1, policy.max_redrives, result.after, f" ({result.error})" if result.error else "")
        self.metrics.redrives.labels(self.dlq.app, entry.handler, outcome).inc()
        return outcome

    def _gauges(self, waiting: dict[str, int], exhausted: dict[str, int]) -> None:
        for handler in {*self.handlers, *waiting, *exhausted}:
            self.metrics.redrive_waiting.labels(self.dlq.app, handler).set(waiting.get(handler, 0))
            self.metrics.redrive_exhausted.labels(self.dlq.app, handler).set(exhausted.get(handler, 0))
