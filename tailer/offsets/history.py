"""Every offsets reset, recorded in the store: who did it, when, to what, and each position's from and to.

A reset is the system cell ``(row of its id, "_offsets_reset", 1)``. All of them live in one shard (each id's
row key chosen to fall there, as the job records do), so the history is that shard's log read with the column
filter, not a scan of every shard.
"""

from __future__ import annotations

import datetime as dt
import getpass
import secrets
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from logstore import Store
from logstore.cell import key_in_shard, shard_of
from logstore.persistence import TruncatedPage
from tailer.offsets.places import ResetPlan

RESET_COLUMN = "_offsets_reset"
_NAMESPACE = uuid.UUID("6f1c2a9e-4d3b-4b8a-9e57-1c0d2f3a4b5c")
_PAGE = 1000


def new_reset_id() -> str:
    """``reset-`` and 6 hex digits: short enough to type, like a job's id."""
    return f"reset-{secrets.token_hex(3)}"


def who() -> str:
    """``user@host`` of this process: the operator a reset is recorded for."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class ResetRecord:
    """One reset as recorded. ``changes`` are ``[key, from, to]`` of each position it moved."""

    id: str
    at: dt.datetime
    by: str
    consumer: str
    place: str
    where: str
    to: str
    changes: list[list[Any]]
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at.isoformat(), "by": self.by, "consumer": self.consumer,
                "place": self.place, "where": self.where, "to": self.to, "moved": len(self.changes),
                "changes": self.changes, "reason": self.reason}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ResetRecord:
        return cls(id=str(doc["id"]), at=dt.datetime.fromisoformat(doc["at"]), by=str(doc["by"]),
                   consumer=str(doc["consumer"]), place=str(doc["place"]), where=str(doc["where"]),
                   to=str(doc["to"]), changes=list(doc["changes"]), reason=str(doc.get("reason", "")))


class ResetHistory:
    """The store's record of offsets resets."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.shard = shard_of(uuid.uuid5(_NAMESPACE, "offsets-resets"), store.shard_count)

    def record(self, record: ResetRecord) -> None:
        """Write ``record``.

        Raises:
            LogstoreError: the store cannot be written (the reset itself is done by then: the error says so).
        """
        key = key_in_shard(_NAMESPACE, record.id, self.shard, self.store.shard_count)
        self.store.put_system_cells([(key, RESET_COLUMN, 1, record.to_json())])

    def record_plan(self, plan: ResetPlan, reason: str = "") -> ResetRecord:
        """Record a reset carried out (``plan.reset_id`` set); the positions it moved, not the ones it left.

        Raises:
            LogstoreError: the store cannot be written.
        """
        assert plan.reset_id is not None, "only a reset carried out is recorded"
        record = ResetRecord(plan.reset_id, dt.datetime.now(dt.UTC), who(), plan.name, plan.place, plan.where,
                             plan.target, [[key, before, after] for key, before, after in plan.changes
                                           if before != after], reason)
        self.record(record)
        return record

    def resets(self, consumer: str | None = None) -> list[ResetRecord]:
        """Every recorded reset (of ``consumer`` when given), oldest first."""
        out: list[ResetRecord] = []
        location = 0
        while True:
            page, location = self.store.get_cells_for_shard(self.shard, location, _PAGE, columns=[RESET_COLUMN])
            out.extend(ResetRecord.from_json(cell.body) for cell in page)
            if len(page) < _PAGE and not isinstance(page, TruncatedPage):
                break
        return [r for r in out if consumer is None or r.consumer == consumer]
