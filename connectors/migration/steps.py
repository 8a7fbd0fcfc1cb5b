"""The steps that move a migration's writes: ``migrate switch --writes``, ``migrate reverse``, ``migrate complete``
(Vitess MoveTables' SwitchTraffic, ReverseTraffic and Complete).

A step's command checks the record's phase and what the step needs, then writes the step's request phase
(``switching``, ``reversing``, ``completing``). The process following the migration (``migrate start``, the one
that holds its capture) carries it out (:meth:`connectors.migration.mover.Mover.run`): for a switch, it waits
until no writer can still be writing to the source (:mod:`connectors.migration.writes`), applies the source's
last changes, starts the flow back at the store's heads and records ``switched``. For a reverse, it waits the
same for the store's writers, flows the last cells back, records the source's log position (the capture skips
what lies below it: the flow back's own writes) and records ``copied``. To complete, it flows the last cells
back, drops the capture and records ``completed``. The command waits for that; if no process carries it out in
time it calls the step off (the writes go on where they went) and says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from connectors.errors import MigrationStateError
from connectors.migration.flow_back import FlowBack, key_columns_held
from connectors.migration.records import MigrationRecord, MigrationRecords
from connectors.migration.source import MigrationSource
from connectors.migration.spec import MigrationSpec
from logstore import Store

logger = logging.getLogger(__name__)
Step = Literal["switch", "reverse", "complete"]
# step -> (the phase it starts from, the phase it asks for, the phase it ends in)
STEPS: dict[Step, tuple[str, str, str]] = {
    "switch": ("copied", "switching", "switched"),
    "reverse": ("switched", "reversing", "copied"),
    "complete": ("switched", "completing", "completed"),
}
_FIRST = {"copying": "the copy must end first (`migrate start` until `migrate status` says copied)",
          "copied": "the writes go to the source: `migrate switch --writes` first",
          "switched": "the writes go to the store already",
          "cancelled": "it was cancelled", "completed": "it is completed"}


def request(store: Store, spec: MigrationSpec, source: MigrationSource, step: Step, *,
            max_lag: float, max_behind: int) -> MigrationRecord:
    """Check that ``step`` fits the migration now, then ask for it in the record.

    Args:
        max_lag: a switch is refused while the capture is more seconds than this behind the source.
        max_behind: a reverse is refused while more cells than this wait to flow back.

    Returns:
        The record asking for the step.

    Raises:
        MigrationStateError: the step is out of order, another step is under way, the capture lags, the reads
            are not switched (a switch of the writes comes after the reads'), or the cells do not hold the
            source's key (the flow back could not name a row). The message says what comes first.
    """
    start, asked, _ = STEPS[step]
    name = spec.name
    record = MigrationRecords(store).get(name)
    if step == "complete" and record.phase == "completed":
        source.stop_changes()  # again: the process that completed it may have stopped before it dropped them
        return record
    if record.phase != start:
        why = (f"{record.phase} is under way" if record.phase in ("switching", "reversing", "completing")
               else _FIRST.get(record.phase, record.phase))
        raise MigrationStateError(f"migration {name} is {record.phase}, and {step} runs from {start}: {why}")
    if step == "switch":
        if record.read_percent != 100:
            raise MigrationStateError(f"migration {name}: the reads are at {record.read_percent or 0}%: the writes "
                                      "switch after the reads (`migrate switch --reads 100`, once the match rate "
                                      "says so)")
        if missing := key_columns_held(spec, source.key_columns()):
            raise MigrationStateError(f"migration {name}: its cells do not hold the key column {missing[0]}, so "
                                      "the flow back could not name a row of the source: add it to a column's "
                                      "fields (a new migration)")
        lag = source.change_lag()
        if lag.seconds > max_lag:
            raise MigrationStateError(f"migration {name}: the capture is {lag.seconds:.0f} s behind the source "
                                      f"(over {max_lag:g}): switch once `migrate status` shows it caught up")
    if step == "reverse":
        behind = FlowBack(spec, source, store).behind()
        if behind > max_behind:
            raise MigrationStateError(f"migration {name}: {behind:,} cells wait to flow back to the source (over "
                                      f"{max_behind:,}): reverse once the flow back caught up")

    def ask(r: MigrationRecord) -> None:
        if r.phase != start:
            raise MigrationStateError(f"migration {name} became {r.phase} meanwhile")
        r.phase = asked  # type: ignore[assignment]  # a Phase, by STEPS
        r.step_error = None
    return MigrationRecords(store).change(name, ask)


def wait(store: Store, spec: MigrationSpec, step: Step, *, timeout: float,
         progress: Callable[[MigrationRecord], None] | None = None, poll: float = 0.2) -> MigrationRecord:
    """Wait until the process following the migration carried ``step`` out.

    Returns:
        The record in the step's end phase.

    Raises:
        MigrationStateError: no process carried it out within ``timeout`` seconds: the step is called off (the
            record back in its start phase, with the reason), unless it ended meanwhile.
    """
    start, asked, end = STEPS[step]
    records = MigrationRecords(store)
    deadline = time.monotonic() + timeout
    while True:
        record = records.get(spec.name)
        if progress is not None:
            progress(record)
        if record.phase != asked:
            if record.phase == end:
                return record
            raise MigrationStateError(f"migration {spec.name}: {step} ended in {record.phase}"
                                      + (f": {record.step_error}" if record.step_error else ""))
        if time.monotonic() > deadline:
            break
        time.sleep(poll)
    why = (f"no `cellstream migrate start` process carried out {step} within {timeout:g} s: it was called off, "
           "and the writes go on where they went; run the step again with one following the migration")

    def call_off(r: MigrationRecord) -> None:
        if r.phase == asked:
            r.phase, r.step_error = start, why  # type: ignore[assignment]
    record = records.change(spec.name, call_off)
    if record.phase == end:  # carried out just now
        return record
    raise MigrationStateError(f"migration {spec.name}: {why}")
