"""Backups and restores (``cellstream backup``, ``cellstream restore``)::

  cellstream backup create DEST [--incremental] [--rate CELLS/S] [--chunk-shards N] [--detach]
  cellstream backup list DEST
  cellstream backup verify DEST [ID]
  cellstream restore SOURCE --to URL|CLUSTER [--backup ID] [--until TIME] [--shards A-B] [--no-index-rebuild]

DEST and SOURCE are a directory or ``s3://bucket/prefix`` (credentials from the environment or a file, never
the command line). ``create`` backs up ``--store`` while writers go on, as a job (``cellstream jobs``: pause,
throttle); run again after an interruption, it resumes the unfinished job. ``verify`` exits 6 naming each
damaged file. ``restore`` writes into an empty instance (created with the backup's shard count when missing)
and refuses a damaged backup or a non-empty target before writing anything; it then rebuilds the index
versions from the restored cells.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output, Parser, store_with_password, time_arg
from cellstream.cli.exits import Exit
from cellstream.cli.progress import Bar
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from logstore import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("backup", help="back the store up to a directory or s3://; list and verify backups")
    actions = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    a = actions.add_parser("create", parents=[common], help="an online backup of --store (resumes an unfinished one)")
    a.add_argument("dest", help="a directory or s3://bucket/prefix")
    a.add_argument("--incremental", action="store_true", help="only the cells above the newest backup's watermarks")
    a.add_argument("--rate", type=float, default=None, metavar="CELLS/S", help="cells read a second at most")
    a.add_argument("--chunk-shards", type=int, default=None, metavar="N",
                   help="shards a cell file (default: as many as make files of about 100,000 cells)")
    a.add_argument("--detach", action="store_true",
                   help="record the backup job and exit (`cellstream jobs resume ID --run` runs it)")
    a.set_defaults(run=cmd_create)
    a = actions.add_parser("list", parents=[common], help="the backups at DEST, oldest first")
    a.add_argument("dest")
    a.set_defaults(run=cmd_list, with_store=False)
    a = actions.add_parser("verify", parents=[common], help="re-read every file of a backup and its chain")
    a.add_argument("dest")
    a.add_argument("id", nargs="?", help="the backup (default: the newest)")
    a.set_defaults(run=cmd_verify, with_store=False)
    p = sub.add_parser("restore", parents=[common], help="restore a backup into a new, empty instance")
    p.add_argument("source", help="a directory or s3://bucket/prefix")
    p.add_argument("--to", required=True, metavar="URL|CLUSTER",
                   help="the empty instance: a store URL (password as --store's) or a cluster file")
    p.add_argument("--backup", default=None, metavar="ID", help="the backup (default: the newest)")
    p.add_argument("--until", type=_until_arg, default=None, metavar="TIME",
                   help="keep the cells created at or before TIME (ISO 8601; UTC when no offset is given)")
    p.add_argument("--shards", type=_shards_arg, default=None, metavar="A-B", help="restore shards A to B only")
    p.add_argument("--no-index-rebuild", action="store_true",
                   help="create the index versions' tables empty and leave them to `cellstream index backfill`")
    p.set_defaults(run=cmd_restore, with_store=False)


def _until_arg(text: str) -> dt.datetime:
    return time_arg(text, "--until")


def _shards_arg(text: str) -> tuple[int, int]:
    first, dash, last = text.partition("-")
    try:
        return (int(first), int(last)) if dash else (int(first), int(first))
    except ValueError:
        raise UsageError(f"--shards {text!r} is not a range such as 0-255") from None


def cmd_create(store: Store, args: argparse.Namespace, out: Output) -> int:
    """The backup as a job (kind ``backup``) run here with a progress bar; an unfinished backup job to the same
    destination is resumed instead of starting another."""
    from cellstream.cli.jobs import known_kinds
    from logstore.backup.job import KIND, job_params
    from logstore.backup.manifest import read_manifest
    from logstore.backup.storage import open_storage
    from logstore.jobs import JobRecord, JobRunner, JobStore, ThrottleSettings

    jobs = JobStore(store)
    unfinished = [r for r in jobs.jobs() if r.kind == KIND and r.state not in ("done", "cancelled")
                  and r.params.get("dest") == args.dest]
    if unfinished:
        record = unfinished[-1]
        print(f"cellstream: backup job {record.id} to {args.dest} is unfinished: resuming it", file=sys.stderr)
        if record.state in ("paused", "failed"):
            record = jobs.resume(record.id)
    else:
        throttle = ThrottleSettings(rate=args.rate) if args.rate is not None else None
        params = job_params(store, args.dest, incremental=args.incremental, chunk_shards=args.chunk_shards)
        record = JobRunner(store, known_kinds(store)).submit(KIND, params, throttle=throttle)
    if args.detach:
        out.emit(record.summary(), f"job {record.id} planned: backup {record.params['backup_id']} "
                                   f"(`cellstream jobs resume {record.id} --run` runs it)")
        return Exit.OK
    with Bar(out, "cells", desc="backup") as bar:
        def show(current: JobRecord) -> None:
            bar.show(current.done, current.total)
        final = JobRunner(store, known_kinds(store), on_progress=show).run(record.id)
    if final.state != "done":
        out.emit(final.summary(), f"job {final.id} {final.state}" + (f"; error: {final.error}" if final.error else "")
                 + f" (`cellstream jobs resume {final.id} --run` goes on)")
        return Exit.FAILED if final.state == "failed" else Exit.STATE
    manifest = read_manifest(open_storage(args.dest), final.params["backup_id"])
    kind = f"incremental over {manifest.parent_id}" if manifest.parent_id else "full"
    out.emit({"backup": manifest.backup_id, "parent": manifest.parent_id, "cells": manifest.cells,
              "files": len(manifest.files) + 1, "created_at": manifest.created_at.isoformat(), "job": final.id},
             f"backup {manifest.backup_id} ({kind}): {manifest.cells:,} cells in {len(manifest.files) + 1} files")
    return Exit.OK


def cmd_list(args: argparse.Namespace, out: Output) -> int:
    from logstore.backup.manifest import backup_ids, read_manifest
    from logstore.backup.storage import open_storage

    storage = open_storage(args.dest)
    finished, unfinished = backup_ids(storage)
    rows = []
    for bid in finished:
        m = read_manifest(storage, bid)
        rows.append({"backup": bid, "parent": m.parent_id, "created_at": m.created_at.isoformat(),
                     "cells": m.cells, "bytes": m.state.size + sum(f.size for f in m.files), "finished": True})
    rows += [{"backup": bid, "finished": False} for bid in unfinished]
    lines = [f"{'backup':<32} {'kind':<12} {'cells':>12} {'bytes':>14}  created_at"]
    for r in rows:
        if not r["finished"]:
            lines.append(f"{r['backup']:<32} unfinished   (`backup create` resumes it)")
            continue
        kind = "incremental" if r["parent"] else "full"
        lines.append(f"{r['backup']:<32} {kind:<12} {r['cells']:>12,} {r['bytes']:>14,}  {r['created_at']}")
    out.emit({"backups": rows}, "\n".join(lines))
    return Exit.OK


def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    from logstore.backup.manifest import newest_id
    from logstore.backup.storage import open_storage
    from logstore.backup.verify import verify_chain

    storage = open_storage(args.dest)
    bid = args.id or newest_id(storage)
    manifests, problems = verify_chain(storage, bid)
    files = sum(len(m.files) + 1 for m in manifests)
    for problem in problems:
        print(f"cellstream: {problem}", file=sys.stderr)
    out.emit({"backup": bid, "chain": [m.backup_id for m in manifests], "files": files,
              "damaged": [{"file": p.name, "problem": p.problem} for p in problems]},
             f"backup {bid}: {files} files of {len(manifests)} backups read, "
             + ("all whole" if not problems else f"{len(problems)} damaged"))
    return Exit.OK if not problems else Exit.FAILED


def cmd_restore(args: argparse.Namespace, out: Output) -> int:
    import logstore
    from logstore.backup.restore import RestoreProgress, restore, verified_chain
    from logstore.backup.storage import open_storage

    storage = open_storage(args.source)
    chain = verified_chain(storage, args.backup)  # before the target is opened (created): a damaged backup
    bid, shards = chain[-1].backup_id, chain[-1].shard_count  # leaves no trace there
    target = store_with_password(args.to, getattr(args, "store_password_file", None), sys.argv)
    assert target is not None
    with logstore.open(target, shards=shards) as store, Bar(out, "files", desc="restore") as bar:
        def progress(p: RestoreProgress) -> None:
            bar.show(p.files_done, p.files, f"{p.cells:,} cells")
        report = restore(storage, store, verified=chain, until=args.until, shards=args.shards, progress=progress)
        rebuilt = [] if args.no_index_rebuild else _rebuild_indexes(store, report.indexes)
    out.emit({"backup": bid, "chain": report.chain, "cells": report.cells, "consumers": report.consumers,
              "offsets_lowered": report.offsets_lowered,
              "indexes": [{"name": s.name, "version": s.version, "rebuilt": f"{s.name}@{s.version}" in rebuilt}
                          for s in report.indexes]},
             f"restored backup {bid} ({len(report.chain)} in its chain): {report.cells:,} cells, "
             f"{report.consumers} consumers' offsets ({report.offsets_lowered} lowered to a restored head), "
             f"{len(rebuilt)} of {len(report.indexes)} index versions rebuilt")
    return Exit.OK


def _rebuild_indexes(store: Store, specs: list[Any]) -> list[str]:
    """Each index version backfilled from the restored cells (its catalog is among them); a version no app
    keeps current yet is left to `cellstream index backfill` once its app runs (said on stderr)."""
    from indexer.errors import IndexerError
    from indexer.indexes.backfill import backfill

    done = []
    for spec in specs:
        try:
            backfill(store, spec.name, spec.version)
        except IndexerError as exc:
            print(f"cellstream: index {spec.name} version {spec.version} not rebuilt: {exc}", file=sys.stderr)
            continue
        done.append(f"{spec.name}@{spec.version}")
    return done
