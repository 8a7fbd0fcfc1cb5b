"""Offsets kept in the store: apps and connectors (``app.NAME``), store-coordinated tailers, a migration's flow
back. A reset here is coordinated, never refused: it takes the consumer's shards over with an owner of its own
(``reset:ID``) and commits the new positions under it, the same fencing a second process of the consumer uses.
From then on a running holder's commits of those shards are refused, so it cannot move them back; a
:class:`~tailer.coordinators.store.StoreCoordinator` that finds a reset owner claims the shards again and goes
on from the new positions, and a consumer started later claims them there."""

from __future__ import annotations

from logstore import Store
from logstore.errors import JobNotFoundError
from logstore.jobs import JobStore
from logstore.offsets import RESET_OWNER, is_reset_owner
from tailer.errors import ConsumerNotFoundError, CoordinationError
from tailer.offsets.history import new_reset_id
from tailer.offsets.places import ConsumerPositions, ResetPlan, ShardOffsetsPlace, shard_rows, up_to

REPLAY_PREFIX = "replay."  # the positions of a replay job (indexer/runtime/replay.py): replay.<job id>


class StoreOffsets(ShardOffsetsPlace):
    """The consumers whose offsets the store keeps."""

    kind = "store"
    coordinated = True

    def __init__(self, store: Store) -> None:
        self.store = store
        self.where = "store"

    def consumers(self) -> list[str]:
        """The store's consumers but those of replay jobs that are over (their positions stay, for ``show``)."""
        names = set(self.store.consumers())
        replays = {name for name in names if name.startswith(REPLAY_PREFIX)}
        if replays:
            over = {REPLAY_PREFIX + job.id for job in JobStore(self.store).jobs() if job.state in ("done", "cancelled")}
            names -= replays & over
        return sorted(names)

    def holds(self, name: str) -> bool:
        return bool(self.store.read_offsets(name))

    def positions(self, name: str) -> ConsumerPositions:
        records = self.store.read_offsets(name)
        if not records:
            raise ConsumerNotFoundError(f"no consumer named {name!r} keeps offsets in the store")
        columns = next((record.doc["columns"] for record in records.values() if "columns" in record.doc), None)
        ends = None
        if name.startswith(REPLAY_PREFIX):  # a replay reads its job's columns, up to its ends
            columns, ends = self._replay_range(name.removeprefix(REPLAY_PREFIX))
        rows = shard_rows(self.store, {shard: (record.location, record.owner, None)
                                       for shard, record in records.items()}, columns)
        if ends:
            rows = up_to(self.store, rows, {shard: end for shard, end in ends.items() if shard in records}, columns)
        owners = sorted({row.owner for row in rows if row.owner and not is_reset_owner(row.owner)})
        resets = sorted({row.owner for row in rows if row.owner and is_reset_owner(row.owner)})
        note = ("the store keeps each shard's last holder, not whether it still runs; a reset is handed to a "
                "running holder through its fencing")
        if resets:
            note += f"; reset {', '.join(r.removeprefix(RESET_OWNER) for r in resets)} not taken up by a process yet"
        return ConsumerPositions(name, self.kind, self.where, rows, owners, note)

    def _replay_range(self, job_id: str) -> tuple[list[str] | None, dict[int, int] | None]:
        """A replay job's columns and each shard's end, from its record (None where it is gone)."""
        try:
            job = JobStore(self.store).get(job_id)
        except JobNotFoundError:
            return None, None
        ends = {shard: end for step in job.steps
                for shard, end in zip(step.params.get("shards", []), step.params.get("end", []), strict=False)}
        columns = job.params.get("columns")
        return (list(columns) if columns else None), ends

    def execute(self, plan: ResetPlan) -> ResetPlan:
        reset_id = new_reset_id()
        owner = RESET_OWNER + reset_id
        # Only the positions that move: a shard taken under the reset owner is claimed back by its running holder,
        # which costs it a pause; one left where it was costs nothing.
        targets = {int(key): after for key, before, after in plan.changes if before != after}
        if not targets:
            plan.reset_id = reset_id
            return plan
        claimed = self.store.claim_offsets(plan.name, owner, targets)
        fenced = self.store.commit_offsets(plan.name, owner, {
            shard: (location, {**claimed[shard].doc, "reset": reset_id}) for shard, location in targets.items()})
        if fenced:
            raise CoordinationError(f"{plan.name}: {len(fenced)} shards were claimed by another process during "
                                    f"reset {reset_id} (e.g. shard {min(fenced)}); run the reset again")
        plan.reset_id = reset_id
        return plan
