"""Moving a live PostgreSQL or MySQL/MariaDB table into cells (``cellstream migrate``,
:mod:`connectors.migration`)::

  cellstream migrate start FILE [--rate ROWS/S] [--chunk-rows N] [--until-caught-up | --no-follow]
                          [--max-load N] [--max-replica-lag S] [--metrics-port PORT] [--lag-warning S]
  cellstream migrate status FILE [--max-lag S]
  cellstream migrate cancel FILE
  cellstream migrate diff FILE [--chunk-rows N] [--sample RATE] [--rate ROWS/S] [--resume]
  cellstream migrate repair FILE [--chunk-rows N] [--sample RATE] [--rate ROWS/S] [--resume]
  cellstream migrate switch FILE --reads N | --writes [--max-lag S] [--wait S]
  cellstream migrate reverse FILE [--max-behind N] [--wait S]
  cellstream migrate complete FILE [--wait S]

FILE declares the migration (:mod:`connectors.migration.spec`). ``start`` copies the table into ``--store`` in
key chunks while it applies the changes the source logs, then keeps applying them until stopped (Ctrl-C,
SIGTERM); run again after any stop or crash, it goes on from its record. ``--until-caught-up`` exits once the
table is copied and no change is left; ``--no-follow`` once the table is copied. ``status`` prints the phase,
the rows copied, the changes applied and how far the capture is behind the source, and exits 7 when that is
over ``--max-lag`` (the source keeps its log meanwhile). ``cancel`` drops the capture on the source (the slot and
publication, the position row) for good. ``diff`` compares every
source row with its cells and exits 8 when any is missing, different or extra (the first ones listed);
``repair`` writes the cells that make them match (the source wins) and prints what it found. ``switch --reads N``
turns the read facade's dial in the record (:mod:`connectors.migration.facade`), once the copy is done (exit 9
before): the application's readers take it within seconds. ``switch --writes`` (after the reads are at 100) sends
the write facade's writes to the store (:mod:`connectors.migration.writes`) and flows the new cells back to the
source table; ``reverse`` sends them back to the source; ``complete`` ends the flow back and drops the capture.
The three are carried out by the ``migrate start`` process and waited for (:mod:`connectors.migration.steps`);
each is refused (exit 9) out of order or while the side it leaves lags, saying why.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cellstream.cli.common import Output, Parser
from cellstream.cli.exits import Exit
from cellstream.cli.progress import Bar
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from logstore import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("migrate", help="move a live PostgreSQL or MySQL table into cells")
    actions = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    a = actions.add_parser("start", parents=[common], help="copy the table while applying its changes, then follow")
    a.add_argument("file", type=Path, help="the migration's YAML declaration")
    a.add_argument("--rate", type=float, default=None, metavar="ROWS/S", help="rows copied a second at most")
    a.add_argument("--chunk-rows", type=int, default=1000, metavar="N", help="rows a chunk (1000)")
    until = a.add_mutually_exclusive_group()
    until.add_argument("--until-caught-up", action="store_true",
                       help="exit once the table is copied and no change is left to apply")
    until.add_argument("--no-follow", action="store_true", help="exit once the table is copied")
    a.add_argument("--max-load", type=int, default=None, metavar="N",
                   help="the copy waits while more than N statements run on the source (the changes go on)")
    a.add_argument("--max-replica-lag", type=float, default=None, metavar="S",
                   help="the copy waits while the source's replicas are more than S seconds behind (PostgreSQL's "
                        "standbys; a MySQL source's source.replicas)")
    a.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    a.add_argument("--lag-warning", type=float, default=60.0, metavar="S",
                   help="log a warning when the capture is more than S seconds behind the source (60)")
    a.set_defaults(run=cmd_start)
    a = actions.add_parser("status", parents=[common], help="the phase, rows copied, changes applied, change lag")
    a.add_argument("file", type=Path, help="the migration's YAML declaration")
    a.add_argument("--max-lag", type=float, default=300.0, metavar="S",
                   help="exit 7 when the capture is more than S seconds behind the source (300)")
    a.set_defaults(run=cmd_status)
    a = actions.add_parser("cancel", parents=[common], help="end the migration: drop its capture on the source")
    a.add_argument("file", type=Path, help="the migration's YAML declaration")
    a.set_defaults(run=cmd_cancel)
    for action, text in (("diff", "compare the source rows with the cells (exit 8 on any difference)"),
                         ("repair", "write the cells that make them match the source rows")):
        a = actions.add_parser(action, parents=[common], help=text)
        a.add_argument("file", type=Path, help="the migration's YAML declaration")
        a.add_argument("--chunk-rows", type=int, default=1000, metavar="N", help="rows read at a time (1000)")
        a.add_argument("--sample", type=float, default=None, metavar="RATE",
                       help="compare that share of the key chunks, drawn at random (0.01: 1%%); extra rows are "
                            "looked for only without it")
        a.add_argument("--rate", type=float, default=None, metavar="ROWS/S",
                       help="source rows compared a second at most")
        a.add_argument("--resume", action="store_true",
                       help=f"go on with the last {action} that did not finish (killed, or stopped), from its "
                            "last chunk")
        a.set_defaults(run=cmd_diff, repair=action == "repair")
    a = actions.add_parser("switch", parents=[common], help="turn the read dial, or send the writes to the store")
    a.add_argument("file", type=Path, help="the migration's YAML declaration")
    which = a.add_mutually_exclusive_group(required=True)
    which.add_argument("--reads", type=int, default=None, metavar="N",
                       help="0 source only, 1-99 that share of reads compared with the store, 100 store only")
    which.add_argument("--writes", action="store_true",
                       help="the store takes the writes; its new cells flow back to the source table")
    a.add_argument("--max-lag", type=float, default=60.0, metavar="S",
                   help="refuse (exit 9) while the capture is more than S seconds behind the source (60)")
    _waits(a)
    a.set_defaults(run=cmd_switch)
    a = actions.add_parser("reverse", parents=[common], help="send the writes back to the source table")
    a.add_argument("file", type=Path, help="the migration's YAML declaration")
    a.add_argument("--max-behind", type=int, default=10_000, metavar="N",
                   help="refuse (exit 9) while more than N cells wait to flow back to the source (10000)")
    _waits(a)
    a.set_defaults(run=cmd_step, step="reverse")
    a = actions.add_parser("complete", parents=[common], help="end the flow back and drop the source's capture")
    a.add_argument("file", type=Path, help="the migration's YAML declaration")
    _waits(a)
    a.set_defaults(run=cmd_step, step="complete")


def _waits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", type=float, default=60.0, metavar="S",
                        help="how long the `migrate start` process may take to carry the step out before it is "
                             "called off (60)")


def cmd_start(store: Store, args: argparse.Namespace, out: Output) -> int:
    from connectors.migration.mover import MoveMetrics, MoveProgress, Mover
    from connectors.migration.opening import open_source
    from connectors.migration.spec import load_migration

    if args.chunk_rows < 1:
        raise UsageError("--chunk-rows must be at least 1")
    if args.rate is not None and args.rate <= 0:
        raise UsageError("--rate must be above 0")
    spec = load_migration(args.file)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    source = open_source(spec)
    try:
        with Bar(out, "rows", desc=f"migrate {spec.name}") as bar:
            def show(done: MoveProgress) -> None:
                bar.show(done.rows_copied, None)

            metrics = None
            if args.metrics_port is not None:
                metrics = MoveMetrics()
                metrics.serve(args.metrics_port)
            record = Mover(spec, source, store, chunk_rows=args.chunk_rows, rate=args.rate, metrics=metrics,
                           lag_warning=args.lag_warning, max_running=args.max_load,
                           max_replica_lag=args.max_replica_lag).run(
                follow=not args.no_follow, until_caught_up=args.until_caught_up, stop=stop, progress=show)
    finally:
        source.close()
    out.emit(record.model_dump(mode="json"),
             f"migration {spec.name}: {record.phase}, {record.rows_copied:,} rows copied, "
             f"{record.changes_applied:,} changes applied")
    return Exit.OK


def cmd_status(store: Store, args: argparse.Namespace, out: Output) -> int:
    from connectors.migration.opening import open_source
    from connectors.migration.records import MigrationRecords
    from connectors.migration.source import ChangeLag
    from connectors.migration.spec import load_migration

    spec = load_migration(args.file)
    record = MigrationRecords(store).get(spec.name)
    lag = ChangeLag(0, 0.0)  # a cancelled or completed migration captures nothing
    if record.phase not in ("cancelled", "completed"):
        source = open_source(spec)
        try:
            lag = source.change_lag()
        finally:
            source.close()
    lagging = lag.seconds > args.max_lag
    if lagging:
        print(f"cellstream: migration {spec.name}: the capture is {lag.seconds:.0f} s behind the source (over "
              f"--max-lag {args.max_lag:g}): run `cellstream migrate start`, or `migrate cancel` to free the "
              "source's log", file=sys.stderr)
    last = MigrationRecords(store).last_diff(spec.name)
    out.emit({**record.model_dump(mode="json"), "lag_bytes": lag.bytes, "lag_seconds": lag.seconds,
              "last_diff": None if last is None else last.model_dump(mode="json", exclude={"listed"})},
             f"migration {spec.name} ({record.source}): {record.phase}; {record.rows_copied:,} rows copied, "
             f"{record.changes_applied:,} changes applied; the capture is {lag.bytes:,} bytes "
             f"({lag.seconds:.1f} s) behind the source; writes go to the {record.writes}"
             + (f", {record.flowed_back:,} cells flowed back" if record.flowed_back else "")
             + _last_diff(last))
    return Exit.STALLED if lagging else Exit.OK


def _last_diff(state: Any) -> str:
    """The status line's words on the last diff (a DiffState, or None)."""
    if state is None:
        return ""
    kind = "repair" if state.repair else "diff"
    if not state.done:
        return f"; the last {kind} stopped after {state.rows:,} rows (`migrate {kind} --resume`)"
    return (f"; the last {kind} ({state.updated_at:%Y-%m-%d %H:%M} UTC): {state.rows:,} rows, "
            f"{state.missing} missing, {state.different} different, {state.extra} extra")


def cmd_diff(store: Store, args: argparse.Namespace, out: Output) -> int:
    from connectors.errors import MigrationStateError
    from connectors.migration.diff import diff
    from connectors.migration.opening import open_source
    from connectors.migration.records import MigrationRecords
    from connectors.migration.spec import load_migration

    if args.chunk_rows < 1:
        raise UsageError("--chunk-rows must be at least 1")
    if args.sample is not None and not 0 < args.sample <= 1:
        raise UsageError("--sample is a share of the chunks: above 0, at most 1 (0.01 is 1%)")
    if args.rate is not None and args.rate <= 0:
        raise UsageError("--rate must be above 0")
    spec = load_migration(args.file)
    records = MigrationRecords(store)
    records.get(spec.name)  # a migration of that name, or a typed error saying so
    resume = records.last_diff(spec.name) if args.resume else None
    if args.resume:
        if resume is None or resume.done or resume.repair != args.repair:
            what = "repair" if args.repair else "diff"
            raise MigrationStateError(f"migration {spec.name}: no {what} left unfinished to resume: run `migrate "
                                      f"{what}` without --resume")
        if args.sample is not None and args.sample != resume.sample:
            raise UsageError(f"--resume goes on with the diff's own sample ({resume.sample}), not --sample")
        args.sample = resume.sample

    source = open_source(spec, capture=False)
    try:
        with Bar(out, "rows", desc=f"diff {spec.name}") as bar:
            if resume is not None:
                bar.show(resume.rows, None)
            report = diff(spec, source, store, chunk_rows=args.chunk_rows, progress=lambda n: bar.show(n),
                          repair=args.repair, sample=args.sample, rate=args.rate, resume=resume,
                          save=lambda state: records.save_diff(spec.name, state))
    finally:
        source.close()
    listed = [{"kind": kind, "key": None if d.key is None else list(d.key), "row_key": str(d.row_key),
               "column": d.column, "fields": d.fields} for kind, d in report.listed]
    lines = [f"{item['kind']}: " + (f"row {item['key']}" if item["key"] is not None else f"row key {item['row_key']}")
             + f" {item['column']}" + (f" ({', '.join(item['fields'])})" if item["fields"] else "") for item in listed]
    done = "repaired" if args.repair else "found"
    sampled = f" (a {args.sample:.2%} sample; extra rows not looked for)" if args.sample is not None else ""
    out.emit({"rows": report.rows, "missing": report.missing, "different": report.different, "extra": report.extra,
              "ahead": report.ahead, "listed": listed, "repaired": args.repair, "sample": args.sample},
             "\n".join([f"migration {spec.name}: {report.rows:,} source rows compared{sampled}; "
                        f"{report.missing} missing, "
                        f"{report.different} different, {report.extra} extra {done}"
                        + (f"; {report.ahead} cells changed after their row was read (run it again)"
                           if report.ahead else ""), *lines]))
    return Exit.OK if report.clean or args.repair else Exit.MISMATCH


def cmd_switch(store: Store, args: argparse.Namespace, out: Output) -> int:
    from connectors.errors import MigrationStateError
    from connectors.migration.facade import switch_reads
    from connectors.migration.opening import open_source
    from connectors.migration.records import MigrationRecords
    from connectors.migration.spec import load_migration

    if args.writes:
        return cmd_step(store, args, out, "switch")
    if not 0 <= args.reads <= 100:
        raise UsageError("--reads is 0..100")
    spec = load_migration(args.file)
    record = MigrationRecords(store).get(spec.name)
    if record.phase == "copied" and args.reads > 0:  # out of order is refused by switch_reads, saying why
        source = open_source(spec)
        try:
            lag = source.change_lag()
        finally:
            source.close()
        if lag.seconds > args.max_lag:
            raise MigrationStateError(f"migration {spec.name}: the capture is {lag.seconds:.0f} s behind the source "
                                      f"(over --max-lag {args.max_lag:g}): the store would answer with old rows; "
                                      "switch once `migrate status` shows it caught up")
    record = switch_reads(store, spec.name, args.reads)
    served = {0: "the source serves every read", 100: "the store serves every read; the source is not read"}
    out.emit(record.model_dump(mode="json"), f"migration {spec.name}: reads at {args.reads}%: "
             + served.get(args.reads, f"the source serves, {args.reads}% compared with the store"))
    return Exit.OK


def cmd_step(store: Store, args: argparse.Namespace, out: Output, step: str | None = None) -> int:
    """``switch --writes``, ``reverse``, ``complete``: asked for in the record, carried out by ``migrate start``."""
    from connectors.migration.opening import open_source
    from connectors.migration.spec import load_migration
    from connectors.migration.steps import Step, request, wait

    which = cast("Step", step or args.step)
    if args.wait <= 0:
        raise UsageError("--wait must be above 0 seconds")
    spec = load_migration(args.file)
    source = open_source(spec)
    try:
        record = request(store, spec, source, which, max_lag=getattr(args, "max_lag", 60.0),
                         max_behind=getattr(args, "max_behind", 0))
    finally:
        source.close()
    if record.phase != "completed":  # a complete run again only drops what was left
        print(f"cellstream: migration {spec.name}: {record.phase}; waiting for its `migrate start` process",
              file=sys.stderr)
        record = wait(store, spec, which, timeout=args.wait)
    said = {"switched": "the store takes the writes; its new cells flow back to the source table",
            "copied": "the source takes the writes again (reads at 0%); its changes flow into the cells",
            "completed": "the flow back ended and the source's capture is dropped; the store keeps the table"}
    out.emit(record.model_dump(mode="json"), f"migration {spec.name}: {record.phase}: {said[record.phase]}")
    return Exit.OK


def cmd_cancel(store: Store, args: argparse.Namespace, out: Output) -> int:
    from connectors.migration.mover import cancel
    from connectors.migration.opening import open_source
    from connectors.migration.spec import load_migration

    spec = load_migration(args.file)
    source = open_source(spec)
    try:
        record = cancel(spec, source, store)
    finally:
        source.close()
    out.emit(record.model_dump(mode="json"), f"migration {spec.name} cancelled: its capture on the source is "
                                             "dropped; the cells stay")
    return Exit.OK
