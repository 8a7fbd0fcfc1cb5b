"""Backup and restore against ``mariadb-dump`` (issue 52, "Benchmarks": full backup >= 0.8 of ``mariadb-dump`` of
the same database to the same disk; an incremental backup of 10,000 new cells over 1,000,000 costs <= 5% of a full
one; restore >= 0.5 of loading that dump with ``mariadb``).

    python bench/backup_bench.py [--server URL] [--shards 4096] [--cells 1000000] [--new 10000] [--rounds 2]
                                 [--repeat 3]

A fresh database of the MariaDB at ``--server``, an instance of ``--shards`` shards, seeded with ``--cells``
cells (``put_cells`` batches of 2,000 over random keys, a 100-byte pad in each body). Before each timing the
server is let settle (its dirty pages flushed: a drop or a load just before leaves InnoDB busy for seconds,
which would fall on whichever tool runs first). Each round then times:

1. a full backup as ``cellstream backup create`` takes it (a job of kind ``backup``, to a new directory under
   /tmp) and ``mariadb-dump --single-transaction`` of the same database to a file under /tmp (same disk),
   ``--repeat`` times each, alternating (dump first in odd rounds); the medians are compared;
2. ``--new`` more cells, then an incremental backup over that round's last full backup (``--repeat`` times, each
   over the same parent, the median kept);
3. a restore of the full backup (what ``cellstream restore`` does: open the new instance, verify the chain, write
   the cells; no index, so no rebuild) into a fresh database, and ``mariadb DB < dump.sql`` into another fresh
   database, in alternating order (restore first in odd rounds).

Ratios per round: dump / backup (the ratio of the rates, same data), incremental / backup, load / restore;
printed with their means over the rounds (the rounds differ by the ``--new`` cells each adds) and written to
``bench/results/backup.json``. Every database and file made is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymysql

import logstore
from bench.scratch import drop_database
from cellstream.cli.jobs import known_kinds
from logstore.backup.job import KIND, job_params
from logstore.backup.restore import restore, verified_chain
from logstore.backup.storage import open_storage
from logstore.jobs import JobRunner

RESULTS = Path(__file__).resolve().parent / "results" / "backup.json"
BATCH = 2000


class Server(NamedTuple):
    host: str
    port: int
    user: str
    password: str
    database: str


def server_of(url: str) -> Server:
    """The parts of a ``mysql://user:password@host:port/database`` URL."""
    u = urlsplit(url)
    return Server(u.hostname or "127.0.0.1", u.port or 3306, unquote(u.username or ""), unquote(u.password or ""),
                  u.path.lstrip("/"))


def client_args(url: str) -> tuple[list[str], dict[str, str]]:
    """The connection flags of the ``mariadb``/``mariadb-dump`` clients for a mysql:// URL, and their environment
    (the password in MYSQL_PWD: not on a command line)."""
    t = server_of(url)
    return [f"--host={t.host}", f"--port={t.port}", f"--user={t.user}"], {**os.environ, "MYSQL_PWD": t.password}


def create_database(url: str) -> None:
    t = server_of(url)
    conn = pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password)
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{t.database}`")
    conn.close()


def seed(store: logstore.Store, cells: int, start: int) -> None:
    for at in range(start, start + cells, BATCH):
        store.put_cells([(uuid.uuid4(), "bench", 1, {"n": i, "pad": "x" * 100})
                         for i in range(at, min(at + BATCH, start + cells))])


def timed_backup(store: logstore.Store, dest: Path, incremental: bool) -> float:
    """A backup as ``cellstream backup create`` takes it: a job of kind ``backup``, submitted and run here."""
    started = time.perf_counter()
    runner = JobRunner(store, known_kinds(store))
    record = runner.submit(KIND, job_params(store, str(dest), incremental=incremental))
    final = runner.run(record.id)
    if final.state != "done":
        raise RuntimeError(f"backup job {final.id} {final.state}: {final.error}")
    return time.perf_counter() - started


def timed_dump(url: str, dump: Path) -> float:
    flags, env = client_args(url)
    started = time.perf_counter()
    with open(dump, "wb") as out:
        subprocess.run(["mariadb-dump", *flags, "--single-transaction", server_of(url).database],
                       stdout=out, env=env, check=True)
        out.flush()
        os.fsync(out.fileno())  # as the backup's files are synced
    return time.perf_counter() - started


def timed_restore(dest: Path, url: str, shards: int, backup_id: str) -> tuple[float, int]:
    storage = open_storage(str(dest))
    started = time.perf_counter()
    with logstore.open(url, shards=shards) as target:
        report = restore(storage, target, verified=verified_chain(storage, backup_id))
    return time.perf_counter() - started, report.cells


def timed_load(url: str, dump: Path) -> float:
    flags, env = client_args(url)
    started = time.perf_counter()
    create_database(url)
    with open(dump, "rb") as source:
        subprocess.run(["mariadb", *flags, server_of(url).database], stdin=source, env=env,
                       check=True)
    return time.perf_counter() - started


def settle(url: str, timeout: float = 60.0) -> None:
    """Wait until the server has flushed its dirty pages (or ``timeout`` passes)."""
    t = server_of(url)
    conn = pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password)
    deadline = time.monotonic() + timeout
    with conn.cursor() as cur:
        while time.monotonic() < deadline:
            cur.execute("SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_pages_dirty'")
            if int(cur.fetchall()[0][1]) < 100:
                break
            time.sleep(0.5)
    conn.close()


def timed_incremental(store: logstore.Store, parent: Path, increments: Path) -> float:
    """An incremental backup over a copy of ``parent`` (a full backup's folder): each timing over the same one."""
    shutil.rmtree(increments, ignore_errors=True)
    shutil.copytree(parent, increments / parent.name)
    return timed_backup(store, increments, incremental=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    source = f"{args.server}/bench_backup_{tag}"
    made: list[str] = [source]
    work = Path(tempfile.mkdtemp(prefix=f"backup-bench-{tag}-", dir="/tmp"))
    rounds: list[dict[str, Any]] = []
    try:
        with logstore.open(source, shards=args.shards) as store:
            started = time.perf_counter()
            seed(store, args.cells, 0)
            seeded = time.perf_counter() - started
            total = args.cells
            for r in range(args.rounds):
                dest, dump = work / f"backups-{r}", work / f"dump-{r}.sql"
                settle(source)
                t_full = t_dump = 0.0
                for first in (("dump", "backup") if r % 2 == 0 else ("backup", "dump")):
                    if first == "dump":
                        t_dump = statistics.median([timed_dump(source, dump) for _ in range(args.repeat)])
                    else:
                        t_full = statistics.median([timed_backup(store, dest, incremental=False)
                                                    for _ in range(args.repeat)])
                full_id = sorted(p.name for p in dest.iterdir() if p.is_dir())[-1]
                backup_bytes = sum(p.stat().st_size for p in (dest / full_id).iterdir())
                seed(store, args.new, total)
                settle(source)
                increments = dest.with_name(f"increments-{r}")
                t_incr = statistics.median([timed_incremental(store, dest / full_id, increments)
                                            for _ in range(args.repeat)])
                restored_url = f"{args.server}/bench_restored_{tag}_{r}"
                loaded_url = f"{args.server}/bench_loaded_{tag}_{r}"
                made += [restored_url, loaded_url]
                settle(source)
                if r % 2 == 0:
                    t_restore, restored = timed_restore(dest, restored_url, args.shards, full_id)
                    settle(source)
                    t_load = timed_load(loaded_url, dump)
                else:
                    t_load = timed_load(loaded_url, dump)
                    settle(source)
                    t_restore, restored = timed_restore(dest, restored_url, args.shards, full_id)
                drop_database(restored_url)
                drop_database(loaded_url)
                rounds.append({"cells": total, "full_backup_s": t_full, "dump_s": t_dump, "incremental_s": t_incr,
                               "restore_s": t_restore, "load_s": t_load, "restored": restored,
                               "backup_bytes": backup_bytes, "dump_bytes": dump.stat().st_size,
                               "backup_vs_dump": t_dump / t_full, "incremental_share": t_incr / t_full,
                               "restore_vs_load": t_load / t_restore})
                total += args.new
                shutil.rmtree(dest)
                shutil.rmtree(increments, ignore_errors=True)
                dump.unlink()
    finally:
        for url in made:
            drop_database(url)
        shutil.rmtree(work, ignore_errors=True)
    return {"shards": args.shards, "cells": args.cells, "new": args.new, "repeat": args.repeat, "seed_s": seeded,
            "rounds": rounds,
            **{k: statistics.mean(r[k] for r in rounds) for k in ("backup_vs_dump", "incremental_share",
                                                                   "restore_vs_load")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="mysql://cellstream:cellstream@127.0.0.1:3306")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--cells", type=int, default=1_000_000, help="cells seeded before the first round")
    parser.add_argument("--new", type=int, default=10_000, help="cells added before each incremental backup")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="timings of each backup and dump a round (median)")
    args = parser.parse_args()
    r = run(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(r, indent=2) + "\n")
    for i, x in enumerate(r["rounds"], 1):
        print(f"round {i} ({x['cells']} cells, {args.shards} shards): full backup {x['full_backup_s']:.1f} s "
              f"({x['backup_bytes'] / 1e6:.0f} MB), mariadb-dump {x['dump_s']:.1f} s ({x['dump_bytes'] / 1e6:.0f} MB), "
              f"incremental {x['incremental_s']:.2f} s, restore {x['restore_s']:.1f} s, load {x['load_s']:.1f} s")
    print(f"backup vs dump {r['backup_vs_dump']:.2f} (target >= 0.8: "
          f"{'met' if r['backup_vs_dump'] >= 0.8 else 'MISSED'}); incremental {r['incremental_share']:.1%} of a full "
          f"(target <= 5%: {'met' if r['incremental_share'] <= 0.05 else 'MISSED'}); restore vs load "
          f"{r['restore_vs_load']:.2f} (target >= 0.5: {'met' if r['restore_vs_load'] >= 0.5 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
