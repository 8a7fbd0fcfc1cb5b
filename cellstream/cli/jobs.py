"""``cellstream jobs``: see and steer the long operations of a store (compaction, and later rebalances,
backups...), kept as job records in the store itself (see docs/jobs.md).

  cellstream jobs list [--all]
  cellstream jobs show ID
  cellstream jobs pause ID
  cellstream jobs resume ID [--run [--metrics-port PORT]]
  cellstream jobs cancel ID
  cellstream jobs throttle ID [--rate N | --unlimited] [--pause S] [--nice-ratio R] [--concurrency N] [--max-lag S|off]
                             [--max-latency MS|off]

``list`` shows the jobs not over (``--all``: done and cancelled ones too). ``pause`` and ``cancel`` take effect
after the running chunk; ``resume`` makes a paused or failed job wait for a runner, and ``--run`` runs it here
in the foreground (a progress bar on a terminal; Ctrl-C pauses it). ``throttle`` changes the rate of a running
job, or the replica lag and write latency it backs off beyond, within a second or so; ``show`` says what holds
it back. Each feature's own command creates its jobs (``cellstream connect compact``).

Exit codes (:class:`cellstream.cli.exits.Exit`): 0 success (``resume --run``: the job is done), 1 no such job,
2 bad input, 4 a kind this cellstream does not know or a store configuration problem, 5 the store unavailable,
6 ``resume --run``: the job failed (its error is printed), 9 the job is in the wrong state for the command
(``resume --run``: it was paused or cancelled by another command before it finished).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output
from cellstream.cli.exits import Exit
from cellstream.cli.progress import Bar
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from logstore import Store
    from logstore.jobs import JobKind, JobRecord, KindRegistry

# The kinds `cellstream jobs resume --run` can run: a name and how to make the kind for a store. A feature that
# creates jobs adds its kind here (compaction: "compact").
def _compaction(store: Store) -> JobKind:
    from logstore.extras import require

    require("parquet", "compaction of a Parquet lake")
    from connectors.compaction import LakeCompaction

    return LakeCompaction()


def _rebalance(store: Store) -> JobKind:
    from logstore.rebalance import Rebalance

    return Rebalance(store)


def _backup(store: Store) -> JobKind:
    from logstore.backup.job import BackupJob

    return BackupJob(store)


def _replay(store: Store) -> JobKind:
    from cellstream.cli.replay_kind import replay_kind

    return replay_kind(store)


KIND_FACTORIES: dict[str, Callable[[Store], JobKind]] = {"compact": _compaction, "rebalance": _rebalance,
                                                         "backup": _backup, "replay": _replay}


def known_kinds(store: Store) -> KindRegistry:
    """The registry of every kind of :data:`KIND_FACTORIES`, made for ``store``."""
    from logstore.jobs import KindRegistry

    return KindRegistry(make(store) for make in KIND_FACTORIES.values())


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("jobs", help="list, show, pause, resume, cancel and throttle long operations (jobs)")
    actions = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    a = actions.add_parser("list", parents=[common], help="the jobs not over (--all: every job)")
    a.add_argument("--all", action="store_true", help="done and cancelled jobs too")
    for action, text in (("show", "a job's record: state, owner, steps and their progress"),
                         ("pause", "stop a job after its current chunk, keeping its place"),
                         ("cancel", "stop a job for good (steps done stay done)")):
        a = actions.add_parser(action, parents=[common], help=text)
        a.add_argument("id")
    a = actions.add_parser("resume", parents=[common], help="let a paused or failed job go on (--run: run it here)")
    a.add_argument("id")
    a.add_argument("--run", action="store_true", dest="run_here",
                   help="run it in the foreground until it ends (Ctrl-C pauses it)")
    a.add_argument("--metrics-port", type=int, default=None, help="with --run: serve Prometheus metrics here")
    a = actions.add_parser("throttle", parents=[common], help="change a job's rate while it runs")
    a.add_argument("id")
    rate = a.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=_positive, default=None, metavar="N", help="units per second")
    rate.add_argument("--unlimited", action="store_true", help="lift the rate limit")
    a.add_argument("--pause", type=_non_negative, default=None, metavar="S", help="seconds to pause after a chunk")
    a.add_argument("--nice-ratio", type=_non_negative, default=None, metavar="R",
                   help="after a chunk, pause R times as long as it took (1: at work half of the time)")
    a.add_argument("--concurrency", type=int, default=None, metavar="N", help="units worked on at once")
    a.add_argument("--max-lag", type=limit_arg, default=None, metavar="S",
                   help="back off while a replica of a node the job touches lags more seconds (off: never)")
    a.add_argument("--max-latency", type=limit_arg, default=None, metavar="MS",
                   help="back off while a node's write latency is above this many ms (off: never)")
    p.set_defaults(run=run)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not above 0")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is below 0")
    return value


_OFF = "off"


def limit_arg(text: str) -> float | str:
    """A maximum above 0, or ``off``."""
    return _OFF if text.strip().lower() == _OFF else _positive(text)


def run(store: Store, args: argparse.Namespace, out: Output) -> int:
    return int(_ACTIONS[args.action](store, args, out))


def _line(record: JobRecord) -> str:
    total = "?" if record.total is None else str(record.total)
    steps = sum(1 for s in record.steps if s.state == "done")
    owner = f" owner={record.owner}" if record.owner else ""
    error = f" error={record.error!r}" if record.error and record.state in ("failed", "running") else ""
    backoff = f" backing-off={record.backoff.detail!r}" if record.backoff and record.state == "running" else ""
    return (f"{record.id:<20} {record.kind:<10} {record.state:<10} {record.done}/{total} {record.unit} "
            f"steps {steps}/{len(record.steps)}{owner}{error}{backoff}")


def _throttle_text(record: JobRecord) -> str:
    t = record.throttle
    rate = "unlimited" if t.rate is None else f"{t.rate:g} {record.unit}/s"
    lag = "off" if t.max_lag_seconds is None else f"{t.max_lag_seconds:g} s"
    latency = "off" if t.max_latency_ms is None else f"{t.max_latency_ms:g} ms"
    return (f"throttle {rate}, pause {t.pause_seconds:g}s, nice ratio {t.nice_ratio:g}, concurrency {t.concurrency}, "
            f"max lag {lag}, max latency {latency}")


def _list(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.jobs import JobStore
    from logstore.jobs.records import FINAL_STATES

    records = [r for r in JobStore(store).jobs() if args.all or r.state not in FINAL_STATES]
    if out.as_json:
        out.emit([r.summary() for r in records], "")
    else:
        for record in records:
            out.emit(None, _line(record))
        if not records:
            out.emit(None, "no jobs" if args.all else "no jobs running or waiting (--all lists those over)")
    return Exit.OK


def _show(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.jobs import JobStore

    record = JobStore(store).get(args.id)
    kinds = known_kinds(store) if record.kind in KIND_FACTORIES else None
    kind = kinds.get(record.kind) if kinds is not None else None
    about = kind.describe(record) if kind is not None else f"params: {record.params}"
    lines = [_line(record), f"  {about}", f"  {_throttle_text(record)}",
             f"  created {record.created_at.isoformat()}, updated {record.updated_at.isoformat()}"
             + (f", lease until {record.lease_expires.isoformat()}" if record.lease_expires else "")]
    if record.backoff is not None and record.state == "running":
        lines.append(f"  throttled since {record.backoff.since.isoformat(timespec='seconds')}: "
                     f"{record.backoff.detail}")
    for n, step in enumerate(record.steps, 1):
        total = "?" if step.total is None else str(step.total)
        error = f" error={step.error!r}" if step.error else ""
        lines.append(f"  {n}. {step.name}: {step.state} {step.done}/{total}"
                     + (f" attempts={step.attempts}" if step.attempts else "") + error)
    if (pace := _rate(record)) is not None:
        rate, eta = pace
        lines.append(f"  rate {rate:,.0f} {record.unit}/s" + (f", about {_duration(eta)} left" if eta else ""))
    if kind is not None:
        lines += [f"  {line}" for line in kind.details(record)]
    out.emit(record.to_json(), "\n".join(lines))
    return Exit.OK


def _rate(record: JobRecord) -> tuple[float, float | None] | None:
    """Units a second since the job started, and the seconds left at that rate (None: no total), while it runs."""
    if record.state != "running" or record.started_at is None or not record.done:
        return None
    seconds = (record.updated_at - record.started_at).total_seconds()
    if seconds <= 0:
        return None
    rate = record.done / seconds
    total = record.total
    return rate, (max(0, total - record.done) / rate if total is not None else None)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _changed(record: JobRecord, out: Output, what: str) -> int:
    out.emit(record.summary(), f"job {record.id}: {what} (state {record.state})")
    return Exit.OK


def _pause(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.jobs import JobStore

    return _changed(JobStore(store).pause(args.id), out, "pauses after its current chunk")


def _cancel(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.jobs import JobStore

    record = JobStore(store).cancel(args.id)
    return _changed(record, out, "cancelled" if record.state == "cancelled" else "stops after its current chunk")


def _throttle(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.jobs import JobStore

    settings: dict[str, Any] = {}
    if args.rate is not None or args.unlimited:
        settings["rate"] = args.rate
    if args.pause is not None:
        settings["pause_seconds"] = args.pause
    if args.nice_ratio is not None:
        settings["nice_ratio"] = args.nice_ratio
    if args.concurrency is not None:
        settings["concurrency"] = args.concurrency
    if args.max_lag is not None:
        settings["max_lag_seconds"] = None if args.max_lag == _OFF else args.max_lag
    if args.max_latency is not None:
        settings["max_latency_ms"] = None if args.max_latency == _OFF else args.max_latency
    if not settings:
        raise UsageError("jobs throttle: give --rate N, --unlimited, --pause S, --nice-ratio R, --concurrency N, "
                         "--max-lag S or --max-latency MS")
    record = JobStore(store).set_throttle(args.id, **settings)
    return _changed(record, out, _throttle_text(record))


def _resume(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.jobs import JobStore

    if args.metrics_port is not None and not args.run_here:
        raise UsageError("jobs resume: --metrics-port goes with --run")
    jobs = JobStore(store)
    record = jobs.resume(args.id)
    if not args.run_here:
        return _changed(record, out, "waits for a runner (`cellstream jobs resume ID --run` runs it here)")
    return run_here(store, record, args, out)


def run_here(store: Store, record: JobRecord, args: argparse.Namespace, out: Output) -> int:
    """Run ``record``'s job in the foreground with a progress bar (``args.metrics_port``: serve its metrics);
    the exit code says how it ended (0 done, 6 failed, 9 paused or cancelled by another command)."""
    from logstore.jobs import JobMetrics, JobRunner

    kinds = known_kinds(store)
    kinds.get(record.kind)  # an unknown kind fails before the lease is taken
    metrics = JobMetrics()
    with Bar(out, record.unit, desc=record.id, total=record.total) as bar:
        def show(current: JobRecord) -> None:
            running = next((n for n, s in enumerate(current.steps, 1) if s.state != "done"), len(current.steps))
            bar.show(current.done, current.total, f"step {running}/{len(current.steps)}")
        runner = JobRunner(store, kinds, metrics=metrics, on_progress=show)
        if args.metrics_port is not None:
            metrics.watch(runner.jobs)
            metrics.serve(args.metrics_port)
        final = runner.run(record.id)
    summary = final.summary()
    what = f"{final.state}: {final.done} {final.unit}" + (f"; error: {final.error}" if final.state == "failed" else "")
    details = kinds.get(final.kind).details(final)  # what the steps did beyond their counts (dead letters...)
    out.emit({**summary, "details": details}, "\n  ".join([f"job {final.id} {what}", *details]))
    if final.state == "done":
        return Exit.OK
    return Exit.FAILED if final.state == "failed" else Exit.STATE


_ACTIONS = {"list": _list, "show": _show, "pause": _pause, "resume": _resume, "cancel": _cancel,
            "throttle": _throttle}
