"""``cellstream replay``: run an app's handlers (or a connector's sink) again over a range of the shard logs, as a
job beside the live app (:mod:`indexer.runtime.replay`; docs/jobs.md).

  cellstream replay MODULE:APP|CONNECTOR.yaml --from POSITION [--until POSITION] [--shards RANGE] [--latest-only]
                    [--rate N] [--detach] [--metrics-port PORT]

POSITION is ``beginning``, ``end``, an ISO-8601 time with a zone, or ``SHARD:LOCATION[,SHARD:LOCATION...]``
(:mod:`logstore.positions`); RANGE is ``0-99,200``. The range ends at each shard's head when the job is planned,
or at ``--until`` when earlier. APP is taken as ``cellstream run`` takes it (``--store``, if given, must be its
store); a connector's YAML needs ``--store``. The job runs here with a progress bar (Ctrl-C pauses it) unless
``--detach``; ``cellstream jobs resume ID --run`` goes on with it after a crash, from where its positions were last
committed. Exit codes: as ``cellstream jobs resume --run`` (0 done, 6 failed, 9 paused or cancelled by another
command), 2 a bad position or shard set, 4 a configuration problem (the app, the connector, a lake that holds
positions already), 5 the store unavailable.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output, tune_for_streaming
from cellstream.cli.exits import Exit
from cellstream.cli.replay_kind import load_replayed
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from indexer import App
    from logstore import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("replay", parents=[common],
                       help="run an app's handlers (or a connector's sink) again over a range of the log, as a job")
    p.add_argument("app", metavar="MODULE:APP|CONNECTOR.yaml")
    p.add_argument("--from", dest="start", required=True, metavar="POSITION",
                   help="beginning, end, an ISO-8601 time, or SHARD:LOCATION[,...]: the cells after it")
    p.add_argument("--until", default=None, metavar="POSITION",
                   help="end the range here when before the shards' heads (default: their heads now)")
    p.add_argument("--shards", default=None, metavar="RANGE", help="only these shards, e.g. 0-99,200")
    p.add_argument("--latest-only", action="store_true",
                   help="deliver only the cells that are the newest version of their (row, column)")
    p.add_argument("--rate", type=_rate, default=None, metavar="N", help="at most N cells a second")
    p.add_argument("--detach", action="store_true",
                   help="record the job and exit (`cellstream jobs resume ID --run` runs it)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the job's Prometheus metrics on this port")
    p.set_defaults(run=cmd_replay, with_store=False)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def _reference(spec: str) -> dict[str, Any]:
    """What a job records to load the app again, from any directory: a connector's file or an app's file made
    absolute, and for an app module the directory it was imported from."""
    if spec.endswith((".yaml", ".yml")):
        return {"connector": str(Path(spec).resolve())}
    module, sep, attribute = spec.rpartition(":")
    if sep and (module.endswith(".py") or "/" in module):
        return {"app": f"{Path(module).resolve()}:{attribute}"}
    return {"app": spec, "cwd": os.getcwd()}


def cmd_replay(args: argparse.Namespace, out: Output) -> int:
    import indexer
    import logstore

    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        raise UsageError("--metrics-port must be a port number")
    reference = _reference(args.app)
    if "connector" in reference:
        if not args.store:
            raise indexer.ConfigurationError(f"{args.app} is a connector: give its store with --store URL")
        store = logstore.open(args.store, create=False)
    else:
        from cellstream.cli.apps import check_store, load_app

        app = load_app(args.app)
        check_store(app, args.store, args.app)
        target = app.store_target
        # A store of the command's own: the job's runner writes to it after the app, closed by each step, is gone.
        store = logstore.open(str(target), create=False) if isinstance(target, str) else target
        app.close()
    try:
        return _plan_and_run(store, reference, args, out)
    finally:
        store.close()


def _plan_and_run(store: Store, reference: dict[str, Any], args: argparse.Namespace, out: Output) -> int:
    from cellstream.cli.jobs import known_kinds, run_here
    from indexer.runtime.replay import positions_consumer, replay_params
    from logstore.jobs import JobRunner, ThrottleSettings

    app, close = load_replayed(reference, store)
    try:
        if "connector" in reference:
            _refuse_a_loaded_lake(app, store)
        params = replay_params(app, reference, start=args.start, until=args.until, shards=args.shards,
                               latest_only=args.latest_only)
    finally:
        close()
    runner = JobRunner(store, known_kinds(store))
    record = runner.submit("replay", params, throttle=ThrottleSettings(rate=args.rate))
    shards = sum(len(step.params["shards"]) for step in record.steps)
    where = f"{shards} shard" + ("" if shards == 1 else "s")
    out.emit(record.summary(), f"job {record.id} planned: {record.total or 0} cells of {', '.join(params['columns'])} "
                               f"in {where}, positions in consumer {positions_consumer(record.id)} "
                               f"(`cellstream jobs resume {record.id} --run` goes on after a crash)")
    if args.detach:
        return Exit.OK
    tune_for_streaming()  # the process runs the app's delivery, as `cellstream run`'s does
    args.run_here = True
    return int(run_here(store, record, args, out))


def _refuse_a_loaded_lake(app: App, store: Store) -> None:
    """A sink that keeps positions with its data (a Parquet lake, Iceberg tables) skips the cells they cover, and
    its commits would race the live connector's: a replay loads a lake or tables of its own (a copy of the YAML
    with another root or table), one that holds no position yet."""
    import indexer

    for trigger in app.triggers:
        sink = getattr(trigger.applier, "sink", None)
        if sink is None:
            continue
        for shard in range(store.shard_count):
            if sink.committed(trigger.column, shard) is not None:
                raise indexer.ConfigurationError(
                    f"connector {app.name}: its sink holds positions already (column {trigger.column}, shard "
                    f"{shard}: the live connector's), so a replay into it would skip those cells; point a copy "
                    "of the YAML at a new root or table to load the range there")
