"""``cellstream run`` and ``cellstream dlq``: run a stream-processing app, triage its dead letters.

  cellstream run MODULE:APP [--workers N | --drain [--timeout S]] [--metrics-port PORT [--per-shard-metrics]]
                 [--kafka-config FILE] [--zookeeper-auth-file FILE]
  cellstream dlq --app MODULE:APP list [--handler H] [--status S] [--error E] [--text T] [--since T] [--until T]
  cellstream dlq --app MODULE:APP stats | show ID
  cellstream dlq --app MODULE:APP replay (ID | --match FILTER) [--dry-run]
  cellstream dlq --app MODULE:APP discard (ID | --match FILTER) (--reason TEXT | --dry-run)
  cellstream dlq --app MODULE:APP policy show | set FIELD=VALUE... [--note TEXT] | reset

MODULE is an importable module (the current directory is on the path) or a file
path; APP is the name of its :class:`indexer.App`. ``--app`` may also be a
connector's YAML file (``cellstream connect``), with ``--store``. A relative store path in the app's
code is the current directory's, as Python's ``open()`` takes it (a connector's ``root:`` is its file's):
loaded from a file elsewhere, the app is warned about (:func:`warn_relative_store`). Exit codes: 0 success,
1 no such dead letter, 2 bad input (a malformed ID too), 4 configuration error, 5 a server unreachable,
6 other failure, 7 a handler stalled (too many open dead letters), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import getpass
import importlib
import importlib.util
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellstream.cli import logsetup
from cellstream.cli.common import (
    Output,
    add_kafka_config,
    add_zookeeper_auth,
    kafka_override,
    tune_for_streaming,
    zookeeper_auth,
)
from cellstream.cli.exits import Exit, exit_code
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from indexer import App
    from indexer.runtime.dlq_store import DeadLetter

logger = logging.getLogger(__name__)


def load_app(spec: str, per_shard_metrics: bool = False, kafka_config: str | None = None,
             zookeeper_auth_file: str | None = None) -> App:
    """The App named by ``module:attribute`` (or ``path/to/file.py:attribute``); ``per_shard_metrics``
    turns the option on whatever the app's code says (``--per-shard-metrics``), ``kafka_config`` (a
    properties file, ``--kafka-config``) replaces a Kafka-mode app's TLS and SASL settings and
    ``zookeeper_auth_file`` (or CELLSTREAM_ZOOKEEPER_AUTH) the ZooKeeper credentials of a direct-mode app."""
    import indexer

    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise indexer.ConfigurationError(
            f"--app {spec!r} must be MODULE:APP, e.g. cellstream.demo.examples.billing:app")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        loader = importlib.util.spec_from_file_location(path.stem, path)
        if loader is None or loader.loader is None or not path.exists():
            raise indexer.ConfigurationError(f"no Python file {module_name}")
        module = importlib.util.module_from_spec(loader)
        sys.modules[path.stem] = module
        loader.loader.exec_module(module)
    else:
        if "" not in sys.path:
            sys.path.insert(0, "")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise indexer.ConfigurationError(f"cannot import {module_name}: {exc}") from None
    app = getattr(module, attribute, None)
    if not isinstance(app, indexer.App):
        raise indexer.ConfigurationError(f"{spec}: {attribute} is not an indexer.App")
    if per_shard_metrics:
        app.config = app.config.model_copy(update={"per_shard_metrics": True})
    security = kafka_override(kafka_config, app.brokers, f"{spec}, a direct-mode app,")
    if security is not None:
        app.config = app.config.model_copy(update={"kafka": security})
    auth = zookeeper_auth(zookeeper_auth_file)
    if auth is not None and app.config.zookeeper:
        app.config = app.config.model_copy(update={"zookeeper_auth": auth})
    elif zookeeper_auth_file is not None:
        raise indexer.ConfigurationError(f"--zookeeper-auth-file: {spec} does not use ZooKeeper (no zookeeper=)")
    return app


def warn_relative_store(app: App, spec: str) -> None:
    """Warn when the app of a file (``path/to/file.py:APP``) outside the current directory names its store
    by a relative path: that path is the current directory's, as Python's ``open()`` takes it, not the file's
    (as a connector's ``root:`` is), so the app's store depends on where the command runs."""
    from logstore.config import parse_node_url
    from logstore.errors import InvalidArgumentError

    module_name = spec.rpartition(":")[0]
    if not (module_name.endswith(".py") or "/" in module_name):
        return  # an importable module: where Python found it says nothing about where its store is
    target = app.store_target
    if not isinstance(target, str) or Path(module_name).resolve().parent == Path.cwd().resolve():
        return
    if "://" in target:
        try:
            where = getattr(parse_node_url(target), "directory", None)
        except InvalidArgumentError:
            return
    else:
        where = Path(target)  # a cluster file
    if not isinstance(where, Path) or where.is_absolute():
        return
    logger.warning("%s names its store by a relative path, %s: that is %s, in the current directory, not beside "
                   "%s; give the app an absolute path to be sure which store it uses",
                   spec, target, where.resolve(), module_name)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run a stream-processing app (MODULE:APP) until SIGTERM")
    p.add_argument("app", metavar="MODULE:APP")
    add_kafka_config(p)
    add_zookeeper_auth(p)
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the shards; more than 1 needs the app's zookeeper= (direct mode) or "
                        "brokers= (Kafka mode), and no --drain")
    p.add_argument("--drain", action="store_true",
                   help="process what is in the log now in this one process, print the counts, exit")
    p.add_argument("--timeout", type=float, default=600.0, help="with --drain: give up after this many seconds")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--per-shard-metrics", action="store_true",
                   help="direct mode: export the lag of every shard (default: totals and the most lagging shards)")
    p.set_defaults(run=cmd_run, with_store=False)

    p = sub.add_parser("dlq", help="triage an app's (or a connector's) dead letters")
    app_help = "the app (MODULE:APP) or connector (its YAML file, with --store)"
    p.add_argument("--app", default=None, metavar="MODULE:APP|CONNECTOR.yaml", help=app_help)
    actions = p.add_subparsers(dest="action", required=True, parser_class=type(p))

    def action(name: str, text: str) -> argparse.ArgumentParser:
        a: argparse.ArgumentParser = actions.add_parser(name, parents=[common], help=text)
        # --app before or after the action; SUPPRESS keeps the one given before when it is not repeated.
        a.add_argument("--app", default=argparse.SUPPRESS, metavar="MODULE:APP|CONNECTOR.yaml", help=app_help)
        return a
    _filters(action("list", "entries, oldest first"))
    _filters(action("stats", "entries grouped by handler and error fingerprint"))
    action("show", "one entry: body, traceback, history").add_argument("id")
    a = action("replay", "run the handler again on an entry, or on --match")
    a.add_argument("id", nargs="?")
    a.add_argument("--match", metavar="FILTER", help="e.g. 'handler=bill_rider,error=Declined' (open entries)")
    a.add_argument("--dry-run", action="store_true", help="list what would be replayed")
    a = action("discard", "close open entries without processing them: an ID, or every open entry --match matches")
    a.add_argument("id", nargs="?")
    a.add_argument("--match", metavar="FILTER", help="e.g. 'handler=bill_rider,error=Declined' (open entries)")
    a.add_argument("--reason", help="why, kept in each entry's history (needed unless --dry-run)")
    a.add_argument("--dry-run", action="store_true", help="list what would be discarded")
    a = action("policy", "the redrive policy in force (show), an operator's change of it (set), or the app's own "
                         "declaration put back (reset)")
    a.add_argument("op", choices=["show", "set", "reset"])
    a.add_argument("fields", nargs="*", metavar="FIELD=VALUE",
                   help="with set: e.g. delay=300 multiplier=2 max_redrives=3 errors=CardDeclined,Timeout "
                        "enabled=false (the other fields stay as in force)")
    a.add_argument("--note", help="with set: why, kept with the change")
    p.set_defaults(run=cmd_dlq, with_store=False)


def _filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--handler")
    p.add_argument("--status", choices=["open", "replayed", "resolved", "discarded"])  # Status; no import at --help
    p.add_argument("--error", help="part of the error class name")
    p.add_argument("--fingerprint")
    p.add_argument("--text", help="part of the error message (any case)")
    p.add_argument("--since", help="last failure at or after this ISO-8601 time")
    p.add_argument("--until", help="last failure before this ISO-8601 time")


def cmd_run(args: argparse.Namespace, out: Output) -> int:
    import indexer

    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    if args.drain and args.workers > 1:
        # A drain ends when its own shards are caught up, and a process whose shards a joining worker takes
        # stops (TakenOverError): N draining processes would end with a failure or a count of part of the log.
        raise UsageError("--drain runs in one process: drop --workers (N processes share the shards only "
                         "while they run, without --drain)")
    app = load_app(args.app, args.per_shard_metrics, args.kafka_config, args.zookeeper_auth_file)
    check_store(app, args.store, args.app)
    app.open_existing_store()
    if args.workers > 1 and not (app.brokers or app.config.zookeeper):
        raise indexer.ConfigurationError(
            "--workers > 1 needs shared coordination: give the app zookeeper=... (direct mode) or brokers=...")
    logsetup.starting("run", args, app=app.name, mode="kafka" if app.brokers else "direct",
                      kafka_security=app.config.kafka.masked() if app.brokers and app.config.kafka else None)
    if args.drain or args.workers == 1:
        # The process is the app's, as a tail command's is its tailer's: direct mode runs the same worker loop.
        tune_for_streaming()
    if args.drain:
        counts = app.drain(args.timeout)
        out.emit(counts._asdict(), f"processed {counts.processed}, retried {counts.retried}, "
                                   f"dead-lettered {counts.dead_lettered}")
        return Exit.OK
    if args.workers == 1:
        app.run(metrics_port=args.metrics_port)
        logger.info("app %s stopped", app.name)
        return Exit.OK
    return _run_workers(args, app.name)


def _worker(spec: str, metrics_port: int | None, per_shard_metrics: bool, kafka_config: str | None,
            zookeeper_auth_file: str | None, log_format: str) -> None:
    """One process of ``run --workers N`` (spawned: it starts with nothing of its parent's but these
    arguments). Its exit code is the table's: an error is one log line, not a traceback."""
    from logstore.errors import CellstreamError

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent forwards SIGTERM; Ctrl-C goes to the parent
    # A SIGTERM while the app loads is noted, not raised: raised, it could land anywhere (in asyncio's set-up,
    # leaving a loop half made); the event loop takes the signal over once it runs.
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: terminated.set())
    logsetup.configure_worker(log_format, multiprocessing.current_process().name)
    name = spec
    try:
        app = load_app(spec, per_shard_metrics, kafka_config, zookeeper_auth_file)
        name = app.name
        tune_for_streaming()
        logger.info("app %s: worker process %d running", name, os.getpid())
        if metrics_port is not None:
            app.metrics.serve(metrics_port)
        asyncio.run(_until_terminated(app, terminated))
    except (CellstreamError, OSError, UnicodeDecodeError) as exc:  # as main() reports them: one line
        logger.error("%s", exc)
        sys.exit(exit_code(exc))
    except Exception:
        logger.exception("worker process %d failed", os.getpid())
        sys.exit(Exit.FAILED)
    logger.info("app %s: worker process %d stopped", name, os.getpid())


async def _until_terminated(app: App, terminated: threading.Event) -> None:
    """Serve ``app`` until SIGTERM, including one that came before the loop handled the signal."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if terminated.is_set():  # checked after the loop took the signal over: none is missed in between
        stop.set()
    await app.run_async(stop)


def _run_workers(args: argparse.Namespace, name: str) -> int:
    """N processes of the same app: they share the shards (ZooKeeper) or partitions (consumer group).
    SIGTERM or SIGINT stops them all; the exit code is the first failed worker's, else 0."""
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_worker, args=(args.app, args.metrics_port + n if args.metrics_port else None,
                                                     args.per_shard_metrics, args.kafka_config,
                                                     args.zookeeper_auth_file, args.log_format),
                               name=f"worker-{n}") for n in range(args.workers)]
    for worker in workers:
        worker.start()

    def forward(signum: int, _frame: Any) -> None:
        logger.info("app %s: %s, stopping %d workers", name, signal.Signals(signum).name, len(workers))
        for worker in workers:
            if worker.pid is not None and worker.is_alive():
                worker.terminate()  # SIGTERM: each stops gracefully
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for worker in workers:
        worker.join()
    failed = [w for w in workers if w.exitcode not in (0, -signal.SIGTERM)]
    for w in failed:
        logger.error("app %s: %s (pid %s) exited with %s", name, w.name, w.pid, w.exitcode)
    logger.info("app %s stopped: %d workers, %d failed", name, len(workers), len(failed))
    codes = [w.exitcode for w in failed if w.exitcode in set(Exit)]  # else a signal ended it (negative)
    return Exit(codes[0]) if codes else Exit.FAILED if failed else Exit.OK


def same_store(a: str, b: str) -> bool:
    """Whether two store targets name the same store (a URL's password and a path's spelling aside)."""
    from logstore.config import parse_node_url

    def key(target: str) -> object:
        if "://" not in target:
            return Path(target).resolve()
        parsed = parse_node_url(target)
        directory = getattr(parsed, "directory", None)
        return directory.resolve() if isinstance(directory, Path) else parsed.redacted()
    return bool(key(a) == key(b))


def check_store(app: App, store: str | None, spec: str) -> None:
    """``--store`` (or CELLSTREAM_STORE) given with an app must name the app's own store: an operator must
    never triage or run one store believing it is another. Without either, an app file's relative store path
    is warned about (:func:`warn_relative_store`)."""
    if store is None:
        warn_relative_store(app, spec)
        return
    import indexer

    target = app.store_target
    if not isinstance(target, str) or not same_store(target, store):
        from logstore.config import parse_node_url

        shown = parse_node_url(store).redacted() if "://" in store else store
        mine = parse_node_url(target).redacted() if isinstance(target, str) and "://" in target else str(target)
        raise indexer.ConfigurationError(f"--store {shown} is not the store of {spec}, which uses {mine}: drop "
                                         "--store (and unset CELLSTREAM_STORE), or point the app at that store")


def dlq_app(args: argparse.Namespace) -> App:
    """The app whose dead letters to triage (``--app``), its store opened (:func:`open_dlq_app`)."""
    if not args.app:
        raise UsageError("dlq needs --app MODULE:APP (or a connector's YAML file with --store)")
    return open_dlq_app(args.app, args.store)


def open_dlq_app(spec: str, store: str | None) -> App:
    """``MODULE:APP``, or a connector's YAML file (with ``store``), with its store opened; a store that does
    not exist is StoreNotFoundError, never created."""
    import indexer

    if not spec.endswith((".yaml", ".yml")):
        app = load_app(spec)
        check_store(app, store, spec)
        app.open_existing_store()
        return app
    import logstore
    from connectors.config import load_connector
    from connectors.runtime import connector_app

    if not store:
        raise indexer.ConfigurationError(f"--app {spec} is a connector: give its store with --store URL")
    return connector_app(load_connector(Path(spec)), logstore.open(store, create=False))[0]


def cli_actor() -> str:
    """Who a triage change from the command line is recorded as: the operating-system user."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        return f"cli:uid {os.getuid()}"


def human_entry(entry: DeadLetter) -> str:
    """A dead letter as a person reads it: the facts first, then the body, the traceback and the history as
    text (with --json the same entry is one JSON document)."""
    c = entry.cell

    def when(t: dt.datetime) -> str:
        return t.isoformat(timespec="seconds").replace("+00:00", "Z")
    lines = [
        f"dead letter {entry.id} ({entry.status})",
        f"  app/handler  {entry.app} / {entry.handler}",
        f"  cell         {c.get('row_key')} {c.get('column')}@{c.get('ref_key')} (shard {c.get('shard')}, "
        f"added_id {c.get('added_id')})",
        f"  source       {', '.join(f'{k} {v}' for k, v in entry.source.items())}",
        f"  error        {entry.error_type}: {entry.message}",
        f"  attempts     {entry.attempts}, first failed {when(entry.first_failure)}, last {when(entry.last_failure)}"
        + (f"; redriven {entry.redrives} times by the redrive policy" if entry.redrives else ""),
        f"  fingerprint  {entry.fingerprint}",
        "body:",
    ]
    body = json.dumps(entry.body, indent=2, ensure_ascii=False) if entry.body is not None else "(not decodable)"
    lines += [f"  {line}" for line in body.splitlines()]
    lines.append("traceback:")
    lines += [f"  {line}" for line in entry.traceback.rstrip().splitlines()]
    lines.append("history:")
    for event in entry.history:
        detail = "; ".join(x for x in (event.note, event.error) if x)
        by = f" by {event.actor}" if event.actor else ""
        lines.append(f"  {when(event.at)} {event.status}{by}" + (f": {detail}" if detail else ""))
    return "\n".join(lines)


def _check_id(action: str, entry_id: str) -> None:
    """A dead letter's ID is a UUID: anything else is a typing slip (bad input), not an entry that is missing."""
    try:
        uuid.UUID(entry_id)
    except ValueError:
        raise UsageError(f"dlq {action}: {entry_id!r} is not a dead letter's ID (a UUID, as `dlq list` "
                         "prints)") from None


def _stats_table(groups: list[dict[str, Any]]) -> str:
    """``dlq stats`` for a person: one line per handler and error fingerprint under a header."""
    def when(text: str) -> str:
        return dt.datetime.fromisoformat(text).isoformat(timespec="seconds").replace("+00:00", "Z")
    rows = [(str(g["count"]), str(g["open"]), g["handler"], g["error_type"], g["fingerprint"],
             when(g["first_seen"]), when(g["last_seen"]), repr(g["example"][:60])) for g in groups]
    header = ("COUNT", "OPEN", "HANDLER", "ERROR", "FINGERPRINT", "FIRST", "LAST", "EXAMPLE")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    right = {0, 1}  # the counts

    def line(row: tuple[str, ...]) -> str:
        cells = [row[i].rjust(w) if i in right else row[i].ljust(w) for i, w in enumerate(widths)]
        return "  ".join([*cells, row[-1]])
    return "\n".join(line(row) for row in [header, *rows])


def _dlq_policy(app: App, args: argparse.Namespace, out: Output) -> int:
    """``dlq policy show|set|reset``: the redrive policy in force is the store's (indexer.runtime.redrive)."""
    from indexer.errors import InvalidPolicyError
    from indexer.runtime.redrive import PolicyStore, RedrivePolicy, parse_assignments

    policies = PolicyStore(app.dlq.deadletters)
    if args.op == "set":
        current = policies.get()
        try:
            if current is not None and current.policy is not None:
                policy = current.policy.updated(args.fields)
            else:
                policy = RedrivePolicy.parse(parse_assignments(args.fields))
        except InvalidPolicyError as exc:
            raise UsageError(f"dlq policy set: {exc}") from None
        policies.set(policy, cli_actor(), args.note)
    elif args.op == "reset":
        policies.reset(cli_actor())
    history = policies.history()
    if out.as_json:
        out.emit({"app": app.name, "in_force": history[-1].model_dump(mode="json") if history else None,
                  "history": [r.model_dump(mode="json") for r in history]}, "")
        return Exit.OK
    if not history:
        out.emit(None, f"app {app.name} has no redrive policy (declare one: App(..., redrive={{...}}), or "
                       "`dlq policy set delay=300 max_redrives=3`)")
        return Exit.OK
    record = history[-1]
    shown = record.policy.model_dump_json() if record.policy is not None else "none"
    origin = "the app's declaration" if record.origin == "declared" else f"set by {record.actor}"
    lines = [f"redrive policy of {app.name} in force ({origin}, {record.at.isoformat(timespec='seconds')}): {shown}"]
    if record.origin == "operator":
        declared = record.declared.model_dump_json() if record.declared else "none"
        lines.append(f"  declared by the app: {declared} (`dlq policy reset` puts it back in force)")
    lines.append("history:")
    lines += [f"  v{r.version} {r.at.isoformat(timespec='seconds')} {r.actor} ({r.origin})"
              + (f": {r.note}" if r.note else "") for r in history]
    out.emit(None, "\n".join(lines))
    return Exit.OK


def cmd_dlq(args: argparse.Namespace, out: Output) -> int:
    import indexer
    from indexer import DLQFilter

    if getattr(args, "id", None) is not None:
        _check_id(args.action, args.id)
    if args.action == "discard" and not args.dry_run and not (args.reason or "").strip():
        raise UsageError("dlq discard needs --reason TEXT (kept in each entry's history), or --dry-run")
    if args.action == "policy" and (args.op == "set") != bool(args.fields):
        raise UsageError("dlq policy set takes FIELD=VALUE assignments (e.g. delay=300 max_redrives=3); "
                         "show and reset take none")
    app = dlq_app(args)
    dlq = app.dlq
    if args.action == "policy":
        return _dlq_policy(app, args, out)
    if args.action in ("list", "stats"):
        match = DLQFilter.build(handler=args.handler, status=args.status, error=args.error,
                                fingerprint=args.fingerprint, text=args.text, since=args.since,
                                until=args.until)
        if args.action == "list":
            entries = dlq.list(match)
            for entry in entries:
                s = entry.summary()
                out.emit(s, f"{s['id']} {s['status']:9} {s['handler']} {s['error_type']}: {s['message'][:80]} "
                            f"(attempts {s['attempts']}, {s['row_key']}@{s['ref_key']})")
            if not entries and not out.as_json:
                out.emit(None, "no dead letters match")
            return Exit.OK
        groups = dlq.stats(match)
        if out.as_json:
            for group in groups:
                out.emit(group, "")
        elif groups:
            out.emit(None, _stats_table(groups))
        else:
            out.emit(None, "no dead letters match")
        return Exit.OK
    if args.action == "show":
        entry = dlq.show(args.id)
        out.emit(entry.model_dump(mode="json"), human_entry(entry))
        return Exit.OK
    if args.action == "discard":
        if (args.id is None) == (args.match is None):
            raise indexer.InvalidFilterError("discard takes an entry ID or --match FILTER (one of them)")
        if args.id is not None:
            if args.dry_run:
                entry = dlq.show(args.id)
                out.emit(entry.summary(), f"{entry.id} would be discarded ({entry.status} now)")
                return Exit.OK
            entry = dlq.discard(args.id, args.reason, actor=cli_actor())
            out.emit(entry.summary(), f"{entry.id} discarded ({args.reason})")
            return Exit.OK
        # A dry run records nothing: the reason the library asks for is not kept.
        entries = dlq.discard_matching(DLQFilter.parse(args.match), args.reason or "dry run", dry_run=args.dry_run,
                                       actor=cli_actor())
        verb = "would be discarded" if args.dry_run else f"discarded ({args.reason})"
        for entry in entries:
            s = entry.summary()
            out.emit(s, f"{s['id']} {verb}: {s['handler']} {s['error_type']}: {s['message'][:80]}")
        if not entries and not out.as_json:
            out.emit(None, "no open dead letters match")
        return Exit.OK
    if (args.id is None) == (args.match is None):
        raise indexer.InvalidFilterError("replay takes an entry ID or --match FILTER (one of them)")
    results = dlq.replay(args.id, match=DLQFilter.parse(args.match) if args.match else None, dry_run=args.dry_run,
                         actor=cli_actor())
    for r in results:
        out.emit(r._asdict(), f"{r.id} {r.handler}: {r.before} -> {r.after}"
                              + (f" ({r.error})" if r.error else ""))
    if not results and not out.as_json:
        out.emit(None, "nothing to replay")
    # A handler that fails again is not a success: a script replaying after a fix must see it.
    return Exit.FAILED if any(r.error for r in results) else Exit.OK
