"""The storage node commands (``cellstream nodes``) and the rebalance job's launcher, shared with ``cellstream
shards rebalance --apply``::

  cellstream nodes list
  cellstream nodes add NAME URL [--replica URL]... [--password-env VAR | --password-file FILE]
  cellstream nodes drain NAME [--by cells|bytes|writes] [--rate CELLS/S] [--concurrency N] [--max-lag S]
                              [--max-latency MS] [--detach]
  cellstream nodes split NAME --into NEW [the same options]
  cellstream nodes remove NAME
  cellstream nodes promote NAME --replica URL|HOST:PORT [--wait S] [--burn N]

A drain, a split and a rebalance run as a job (``cellstream jobs``) in the foreground with a progress bar;
``--detach`` records it for ``cellstream jobs resume ID --run``. While a rebalance job is unfinished (its
process killed, paused, failed), the next of these commands resumes it rather than planning another.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output, Parser
from cellstream.cli.exits import Exit

if TYPE_CHECKING:
    from logstore import Store
    from logstore.rebalance import Planned


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("nodes", help="the storage nodes: list, add, drain, split, remove (MySQL/MariaDB)")
    actions = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    a = actions.add_parser("list", parents=[common], help="nodes, their state, shards, cells, bytes and health")
    a.set_defaults(run=cmd_list)
    a = actions.add_parser("add", parents=[common], help="an empty database joins the running instance")
    a.add_argument("name")
    a.add_argument("url", help="mysql://user@host:port/db, without a password")
    a.add_argument("--replica", action="append", default=[], metavar="URL", help="a replica of it (repeatable)")
    secret = a.add_mutually_exclusive_group()
    secret.add_argument("--password-env", metavar="VAR", help="the environment variable holding its password "
                                                              "(in every process that opens the store)")
    secret.add_argument("--password-file", metavar="FILE", help="the file holding its password (idem)")
    a.set_defaults(run=cmd_add)
    for action, text in (("drain", "move every shard off a node (a resumable job)"),
                         ("split", "move half of a node's shards to a new, empty node (a resumable job)")):
        a = actions.add_parser(action, parents=[common], help=text)
        a.add_argument("name")
        if action == "split":
            a.add_argument("--into", required=True, metavar="NEW", help="the empty node (`nodes add` it first)")
        weigh_options(a)
        job_options(a)
        a.set_defaults(run=cmd_drain if action == "drain" else cmd_split)
    a = actions.add_parser("remove", parents=[common], help="take a node that holds nothing out of the instance")
    a.add_argument("name")
    a.set_defaults(run=cmd_remove)
    a = actions.add_parser("promote", parents=[common], help="make a replica the node's primary (its primary lost)")
    a.add_argument("name")
    a.add_argument("--replica", required=True, metavar="URL|HOST:PORT", help="the replica (`nodes list` shows them)")
    a.add_argument("--wait", type=float, default=60.0, metavar="S",
                   help="seconds the replica may take to apply what it received (60)")
    a.add_argument("--burn", type=int, default=None, metavar="N",
                   help="ids each shard skips: more than the cells of one shard the replica may lack (1,000,000)")
    a.set_defaults(run=cmd_promote)


def weigh_options(parser: argparse.ArgumentParser) -> None:
    """The options of a command that plans moves: what it evens out."""
    parser.add_argument("--by", choices=("cells", "bytes", "writes"), default="cells",
                        help="even out the nodes' cells (default), stored bytes, or recent writes")
    parser.add_argument("--window", type=float, default=3600.0, metavar="S",
                        help="with --by writes: the cells written in the last S seconds (3600)")


def job_options(parser: argparse.ArgumentParser) -> None:
    """The options of a command that runs a rebalance job."""
    parser.add_argument("--rate", type=float, default=None, metavar="CELLS/S",
                        help="cells copied or deleted a second at most (`cellstream jobs throttle` changes it)")
    from cellstream.cli.jobs import limit_arg

    parser.add_argument("--concurrency", type=int, default=None, metavar="N", help="shards moved at once (1)")
    parser.add_argument("--nice-ratio", type=float, default=0.0, metavar="R",
                        help="after each shard, pause R times as long as its move took (gh-ost's; 0)")
    parser.add_argument("--max-lag", type=limit_arg, default=None, metavar="S",
                        help="back off while a replica of a node of a move lags more seconds (1; off: never)")
    parser.add_argument("--max-latency", type=limit_arg, default=None, metavar="MS",
                        help="back off while a node's write latency is above this many ms (50; off: never)")
    parser.add_argument("--detach", action="store_true",
                        help="record the job and exit (`cellstream jobs resume ID --run` runs it)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")


def cmd_list(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.nodes import list_nodes

    nodes = list_nodes(store)
    width = max([4, *(len(n.name) for n in nodes)])
    lines = [f"{'node':<{width}} {'state':<8} {'shards':>6} {'cells':>12} {'bytes':>14}  health  url"]
    for n in nodes:
        size = "?" if n.bytes is None else f"{n.bytes:,}"
        replicas = f" (replicas: {', '.join(n.replicas)})" if n.replicas else ""
        lines.append(f"{n.name:<{width}} {n.state:<8} {n.shards:>6} {n.cells:>12,} {size:>14}  {n.health}  "
                     f"{n.url}{replicas}")
    out.emit({"version": store.shard_map.version, "nodes": [n._asdict() for n in nodes]}, "\n".join(lines))
    return Exit.OK


def cmd_add(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.nodes import add_node

    entry = add_node(store, args.name, args.url, replicas=args.replica, password_env=args.password_env,
                     password_file=args.password_file)
    out.emit({"node": entry.name, "version": store.shard_map.version},
             f"node {entry.name} joined (shard map version {store.shard_map.version}); it holds no shard yet: "
             f"`cellstream shards rebalance --apply` moves some to it")
    return Exit.OK


def cmd_remove(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.nodes import remove_node

    remove_node(store, args.name)
    out.emit({"node": args.name, "removed": True, "version": store.shard_map.version},
             f"node {args.name} removed (shard map version {store.shard_map.version}); its database is left "
             "as it is")
    return Exit.OK


def cmd_promote(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.nodes import promote_node

    done = promote_node(store, args.name, args.replica, wait=args.wait, burn=args.burn)
    former = ("answered and now refuses writes" if done.former_fenced else
              "does not answer: fenced in the shard map, and its writes refused if it comes back (`nodes list`)")
    out.emit(done._asdict(), f"node {done.node}: primary {done.primary} (shard map version "
                             f"{store.shard_map.version}); the former primary {done.former} {former}; "
                             f"{done.burnt_shards} shards skip {done.burn:,} ids; {done.restored} acknowledged cells "
                             f"written from their durable copies, {done.replayed} buffered cells written to it")
    return Exit.OK


def cmd_drain(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.nodes import set_state
    from logstore.rebalance import rebalance_moves

    if (unfinished := _unfinished(store, out)) is not None:
        return unfinished
    set_state(store, args.name, "draining")
    return launch(store, rebalance_moves(store, by=args.by, window=args.window), f"drain {args.name}", args, out)


def cmd_split(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.rebalance import split_moves

    if (unfinished := _unfinished(store, out)) is not None:
        return unfinished
    planned = split_moves(store, args.name, args.into, by=args.by, window=args.window)
    return launch(store, planned, f"split {args.name} into {args.into}", args, out)


def _unfinished(store: Store, out: Output) -> int | None:
    """Run (here) the rebalance job left unfinished, if there is one: its exit code; None when there is none."""
    from cellstream.cli.jobs import run_here
    from logstore.jobs import JobStore
    from logstore.rebalance import KIND

    jobs = JobStore(store)
    for record in jobs.jobs():
        if record.kind == KIND and record.state not in ("done", "cancelled"):
            print(f"cellstream: job {record.id} ({record.params.get('purpose', KIND)}) is unfinished: resuming it "
                  "first; run the command again once it is done", file=sys.stderr)
            if record.state in ("paused", "failed"):
                record = jobs.resume(record.id)
            args = argparse.Namespace(metrics_port=None, run_here=True)
            return run_here(store, record, args, out)
    return None


def launch(store: Store, planned: Planned, purpose: str, args: argparse.Namespace, out: Output) -> int:
    """Submit a rebalance job of ``planned``'s moves and run it here (or only record it, with ``--detach``)."""
    from cellstream.cli.jobs import known_kinds, run_here
    from cellstream.errors import UsageError
    from logstore.jobs import JobRunner, ThrottleSettings
    from logstore.rebalance import KIND, job_params

    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if not args.nice_ratio >= 0:
        raise UsageError(f"--nice-ratio must be 0 or more, got {args.nice_ratio:g}")
    if not planned.moves:
        out.emit({"id": None, "kind": KIND, "state": "done", "moves": 0}, f"{purpose}: nothing to move")
        return Exit.OK
    limits = {field: None if value == "off" else value
              for field, value in (("max_lag_seconds", args.max_lag), ("max_latency_ms", args.max_latency))
              if value is not None}
    throttle = ThrottleSettings(rate=args.rate, concurrency=args.concurrency or 1, nice_ratio=args.nice_ratio,
                                **limits)
    record = JobRunner(store, known_kinds(store)).submit(KIND, job_params(planned, purpose), throttle=throttle)
    if args.detach:
        out.emit(record.summary(), f"job {record.id} planned: {len(planned.moves)} shard moves, {record.total} "
                                   f"cells (`cellstream jobs resume {record.id} --run` runs it)")
        return Exit.OK
    args.run_here = True
    return run_here(store, record, args, out)
