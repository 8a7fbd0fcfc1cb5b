"""Growing an instance (issue 51, "Benchmarks"): shard moves and rebalance jobs against raw pymysql and against
the writers they run beside, in one run, on fresh databases of the same MariaDB (each a storage node).

    python bench/rebalance_bench.py [--server URL] [--shards S] [--cells N] [--copy-cells N] [--rate CELLS/S]
                                    [--quick]

1. **Copy rate.** ``move_shard`` (unthrottled) of a shard of ``--copy-cells`` cells from node a to node b,
   against a raw pymysql streaming copy of the same rows between the same two databases (``SELECT ... ORDER BY
   added_id LIMIT 5000`` pages, each inserted by one ``executemany`` INSERT into a table ``LIKE cells`` of the
   target). Rounds alternate which goes first, each on a shard of its own (target: ratio of rates >= 0.7).
2. **Writers during a throttled rebalance.** On the instance of part 3, once grown: 4 writers (threads of this
   process, each with its own store: two put 10-cell batches, two single durable cells, each about
   ``--write-rate`` writes/s) while ``cellstream nodes drain c --rate RATE --nice-ratio R`` (a rebalance job,
   default back- off limits) moves node c's shards back to a and b. The job runs in processes of its own, ``--on``
   seconds at a time, paused ``--off`` seconds between (``jobs pause``: the move under way ends first), so that
   the quiet windows (those pauses, and ``--baseline`` seconds before and after) are spread over the job: the
   other load of a shared machine drifts. The writers' p99 while the job runs against their p99 while it does not
   (target <= 2x, over the job: moves and drop steps; each step apart too), and how long writes to a shard were
   fenced: the p99 of every move's ``fenced_seconds`` (target <= 50 ms), and the latency of the writes that met a
   fence or a moved shard.
3. **Growing from 2 nodes to 3.** ``--cells`` cells over every shard of nodes a and b; node c joins
   (``add_node``) and a rebalance job (``Rebalance``, run here, rate unlimited, concurrency 1, default
   back-off) moves a third of the shards and drops their source copies. The moves step and the drop step are
   reported apart (the drop step waits two map refreshes, 10 s, before it deletes), with cells/s. Reported,
   no target. Run before part 2.

The moves of parts 1 and 3 (and the drops of part 3) are profiled: every statement they send (time and count,
by the logstore function sending it), the time in ``Store.refresh_map`` and in the named lock's own
connection, the fence. Results go to ``bench/results/rebalance.json``. All nodes are databases of one
MariaDB server: a move's copy, the writers and the server share its two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymysql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import logstore
import logstore.backends.mysql.moves as moves
from bench.logstore_bench import connect, percentile, trip_body
from bench.scratch import drop_database
from logstore.backends.mysql.recorder import CELL_COLUMNS, MySQLRecorder
from logstore.errors import JobStateError
from logstore.jobs import JobRunner, JobStore, KindRegistry, ThrottleSettings
from logstore.jobs.records import JobRecord
from logstore.nodes import add_node
from logstore.rebalance import KIND, Rebalance, job_params, rebalance_moves
from logstore.registry import url_password, without_password
from logstore.store import Store
from tests.harness.shared_servers import MYSQL_SERVER as SERVER
from tests.harness.stores import two_nodes

COPY_TARGET = 0.7
P99_TARGET = 2.0
FENCED_TARGET_MS = 50.0
PASSWORD_ENV = "CSB_REBALANCE_PW"  # a joining node's password: its URL in the map holds none
REPO = Path(__file__).resolve().parent.parent


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def p99(samples: list[float]) -> float:
    return percentile(samples, 0.99) if samples else float("nan")


# -- the profile of a move ---------------------------------------------------------------------
_OURS = ("moves.py", "index_moves.py", "store.py", "rebalance.py")
_COUNTERS = ("statements", "sql", "refresh_map", "refreshes", "connect", "connects")


class MoveProfile:
    """What ``move_shard`` and ``drop_moved`` cost, call by call, in whatever thread they run: every statement
    they send (time and count, by the logstore function sending it), the time in ``Store.refresh_map`` and in
    new connections (the named lock's), the throttle's waits (not counted as their cost), and the time between
    two calls in one thread (the job's own work between moves)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.statements: dict[tuple[str, str, str], list[float]] = {}  # (op, where, statement) -> [s, count]
        self.calls: dict[str, list[dict[str, float]]] = {}
        self._undo: list[Callable[[], None]] = []

    def reset(self) -> None:
        with self._lock:
            self.statements, self.calls = {}, {}

    def _on(self) -> dict[str, Any] | None:
        call: dict[str, Any] | None = getattr(self._local, "call", None)
        return call

    @staticmethod
    def _where() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.endswith(_OURS) and "/logstore/" in name:
                return f"{Path(name).name}:{frame.f_code.co_qualname}"
            frame = frame.f_back  # type: ignore[assignment]
        return "other"

    def _wrap(self, op: str, fn: Callable[..., Any], shards: Callable[[Any], float]) -> Callable[..., Any]:
        profile = self

        def profiled(store: Store, *args: Any, **kwargs: Any) -> Any:
            call: dict[str, Any] = dict.fromkeys(_COUNTERS, 0.0)
            call["op"] = op
            paced = kwargs.get("pace")
            waited = [0.0]
            if paced is not None:
                def pace(rows: int) -> None:  # the throttle's waits are not the call's cost
                    start = time.perf_counter()
                    paced(rows)
                    waited[0] += time.perf_counter() - start
                kwargs["pace"] = pace
            last = getattr(profile._local, "ended", None)
            profile._local.call = call
            start = time.perf_counter()
            try:
                result = fn(store, *args, **kwargs)
            finally:
                profile._local.call = None
                profile._local.ended = time.perf_counter()
            call["wall"] = profile._local.ended - start - waited[0]
            call["paced"] = waited[0]
            call["between"] = start - last if last is not None else float("nan")
            call["shards"] = shards(args)
            if isinstance(result, moves.MoveReport):
                call["fenced"], call["cells"] = result.fenced_seconds, result.cells
            with profile._lock:
                profile.calls.setdefault(op, []).append(call)
            return result
        return profiled

    def install(self) -> None:
        profile = self
        execute = pymysql.cursors.Cursor.execute

        def timed_execute(cur: pymysql.cursors.Cursor, query: Any, args: Any = None) -> int:
            call = profile._on()
            if call is None:
                return execute(cur, query, args)
            start = time.perf_counter()
            try:
                return execute(cur, query, args)
            finally:
                spent = time.perf_counter() - start
                head = query[:70] if isinstance(query, str) else bytes(query[:70]).decode(errors="replace")
                key = (call["op"], profile._where(), " ".join(head.split())[:56])
                with profile._lock:
                    found = profile.statements.setdefault(key, [0.0, 0])
                    found[0] += spent
                    found[1] += 1
                call["statements"] += 1
                call["sql"] += spent

        refresh = Store.refresh_map

        def timed_refresh(store: Store) -> None:
            call = profile._on()
            start = time.perf_counter()
            try:
                refresh(store)
            finally:
                if call is not None:
                    call["refresh_map"] += time.perf_counter() - start
                    call["refreshes"] += 1

        raw_connect = MySQLRecorder._raw_connect

        def timed_connect(recorder: MySQLRecorder, *args: Any, **kwargs: Any) -> Any:
            call = profile._on()
            start = time.perf_counter()
            try:
                return raw_connect(recorder, *args, **kwargs)
            finally:
                if call is not None:
                    call["connect"] += time.perf_counter() - start
                    call["connects"] += 1

        move_shard, drop_moved = moves.move_shard, moves.drop_moved
        setattr(pymysql.cursors.Cursor, "execute", timed_execute)  # noqa: B010 - a method replaced: mypy refuses =
        setattr(Store, "refresh_map", timed_refresh)  # noqa: B010
        setattr(MySQLRecorder, "_raw_connect", timed_connect)  # noqa: B010
        # Looked up at each call by logstore.rebalance, so its jobs' moves and drops are profiled too.
        moves.move_shard = self._wrap("move", move_shard, lambda args: 1)
        moves.drop_moved = self._wrap("drop", drop_moved, lambda args: len(args[0]))
        self._undo = [lambda: setattr(pymysql.cursors.Cursor, "execute", execute),
                      lambda: setattr(Store, "refresh_map", refresh),
                      lambda: setattr(MySQLRecorder, "_raw_connect", raw_connect),
                      lambda: setattr(moves, "move_shard", move_shard),
                      lambda: setattr(moves, "drop_moved", drop_moved)]

    def uninstall(self) -> None:
        for undo in self._undo:
            undo()

    def summary(self, op: str, top: int = 12) -> dict[str, Any]:
        """Per shard: mean wall ms, statements, round trips; shares of the calls' wall time; the top statements."""
        calls = self.calls.get(op, [])
        if not calls:
            return {"calls": 0}
        n = sum(c["shards"] for c in calls)
        wall = sum(c["wall"] for c in calls)
        total = {k: sum(c[k] for c in calls) for k in (*_COUNTERS, "paced")}
        between = [c["between"] for c in calls if c["between"] == c["between"]]
        rows = sorted(((k[1:], v) for k, v in self.statements.items() if k[0] == op), key=lambda item: -item[1][0])
        out: dict[str, Any] = {
            "calls": len(calls), "shards": n, "wall_ms_per_shard": 1000 * wall / n,
            "statements_per_shard": total["statements"] / n, "connects_per_shard": total["connects"] / n,
            "refreshes_per_shard": total["refreshes"] / n, "paced_ms_per_shard": 1000 * total["paced"] / n,
            "between_ms_median": 1000 * statistics.median(between) if between else None,
            "share": {"statements": total["sql"] / wall, "refresh_map": total["refresh_map"] / wall,
                      "new_connections": total["connect"] / wall,
                      "outside_statements": 1 - (total["sql"] + total["connect"]) / wall},
            "top": [{"where": where, "statement": sql, "per_shard": count / n, "ms_per_shard": 1000 * secs / n,
                     "share": secs / wall} for (where, sql), (secs, count) in rows[:top]],
        }
        if op == "move":
            fenced = [c["fenced"] for c in calls]
            out["cells_per_move"] = sum(c["cells"] for c in calls) / n
            out["fenced_ms"] = {"p50": 1000 * percentile(fenced, 0.5), "p99": 1000 * p99(fenced),
                                "max": 1000 * max(fenced)}
        return out


def print_profile(title: str, s: dict[str, Any]) -> None:
    if not s.get("calls"):
        return
    share = s["share"]
    cells = f", {s['cells_per_move']:.0f} cells each" if "cells_per_move" in s else ""
    print(f"   {title}: {s['shards']} shards in {s['calls']} calls{cells}: {s['wall_ms_per_shard']:.1f} ms a shard "
          f"(throttle waits, {s['paced_ms_per_shard']:.1f} ms, excluded; median gap between calls "
          f"{s['between_ms_median'] or 0:.1f} ms); {s['statements_per_shard']:.1f} statements (round trips), "
          f"{s['connects_per_shard']:.1f} new connections, {s['refreshes_per_shard']:.1f} map refreshes a shard")
    fenced = (f"; fenced p50 {s['fenced_ms']['p50']:.1f} ms, p99 {s['fenced_ms']['p99']:.1f} ms"
              if "fenced_ms" in s else "")
    print(f"   shares: statements {share['statements']:.0%} (map refresh {share['refresh_map']:.0%}), new "
          f"connections {share['new_connections']:.0%}, outside statements (Python, pool) "
          f"{share['outside_statements']:.0%}{fenced}")
    for row in s["top"]:
        print(f"   {row['share']:6.1%} {row['ms_per_shard']:8.2f} ms {row['per_shard']:6.1f}x  {row['where']}: "
              f"{row['statement']}")


# -- instances ------------------------------------------------------------------------------------
class Nodes:
    """Fresh databases (nodes a, b, c...) on the server; a cluster file of a and b; all dropped on close."""

    def __init__(self, server: str, tag: str, shards: int, names: str = "abc") -> None:
        run = uuid.uuid4().hex[:8]
        self.urls = {name: f"{server.rstrip('/')}/bench_rb{tag}_{run}_{name}" for name in names}
        self.dir = Path(tempfile.mkdtemp(prefix="rebalance_bench_"))
        self.cluster = two_nodes(self.dir / "cluster.toml", [self.urls["a"], self.urls["b"]], shards)

    def close(self) -> None:
        for url in self.urls.values():
            drop_database(url)
        shutil.rmtree(self.dir, ignore_errors=True)


def add_c(store: Store, nodes: Nodes) -> None:
    os.environ[PASSWORD_ENV] = url_password(nodes.urls["c"]) or ""
    add_node(store, "c", without_password(nodes.urls["c"]), password_env=PASSWORD_ENV)


def seed(store: Store, cells: int, batch: int = 1000) -> float:
    """``cells`` cells of random keys (every shard) in batches; returns cells/s."""
    start = time.perf_counter()
    for offset in range(0, cells, batch):
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip_body(offset + i)) for i in range(min(batch, cells - offset))])
    return cells / (time.perf_counter() - start)


# -- 1. copy rate ------------------------------------------------------------------------------------
def raw_copy(source: pymysql.connections.Connection, target: pymysql.connections.Connection, shard: int,
             page: int) -> int:
    """The shard's rows, streamed by pages in added_id order from source's cells into target's raw_cells."""
    copied, after = 0, 0
    with source.cursor() as src, target.cursor() as dst:
        while True:
            src.execute(f"SELECT {CELL_COLUMNS} FROM cells WHERE shard = %s AND added_id > %s ORDER BY added_id"
                        " LIMIT %s", (shard, after, page))
            rows = src.fetchall()
            if not rows:
                return copied
            dst.executemany(f"INSERT INTO raw_cells ({CELL_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)", rows)
            copied += len(rows)
            after = rows[-1][1]


def copy_rate(args: argparse.Namespace, profile: MoveProfile) -> dict[str, Any]:
    nodes = Nodes(args.server, "cp", args.shards, "ab")
    try:
        with logstore.open(nodes.cluster) as store:
            shards = [s for s in range(args.shards) if store.node_of(s) == "a"][:args.copy_rounds]
            keys: dict[int, list[uuid.UUID]] = {s: [] for s in shards}
            per_key = 1000
            want = -(-args.copy_cells // per_key)
            while any(len(k) < want for k in keys.values()):  # one pass of random keys for all the shards
                key = uuid.uuid4()
                found = keys.get(store.shard_of(key))
                if found is not None and len(found) < want:
                    found.append(key)
            for shard in shards:
                todo = [(key, "BASE", ref, trip_body(ref)) for key in keys[shard] for ref in range(per_key)]
                for i in range(0, args.copy_cells, 1000):
                    store.put_cells(todo[i:min(i + 1000, args.copy_cells)])
            src, dst = connect(nodes.urls["a"]), connect(nodes.urls["b"])
            with dst.cursor() as cur:
                cur.execute("CREATE TABLE raw_cells LIKE cells")
            rounds: list[dict[str, float]] = []
            profile.reset()
            for r, shard in enumerate(shards):
                figures: dict[str, float] = {}

                def move(shard: int = shard, figures: dict[str, float] = figures) -> None:
                    start = time.perf_counter()
                    report = moves.move_shard(store, shard, "b")
                    figures["move_s"] = time.perf_counter() - start
                    figures["move_fenced_s"] = report.fenced_seconds
                    assert report.cells == args.copy_cells, report

                def raw(shard: int = shard, figures: dict[str, float] = figures) -> None:
                    start = time.perf_counter()
                    assert raw_copy(src, dst, shard, moves.PAGE) == args.copy_cells
                    figures["raw_s"] = time.perf_counter() - start
                    with dst.cursor() as cur:
                        cur.execute("TRUNCATE TABLE raw_cells")
                for part in ((raw, move) if r % 2 == 0 else (move, raw)):
                    part()
                figures["move_cells_per_s"] = args.copy_cells / figures["move_s"]
                figures["raw_cells_per_s"] = args.copy_cells / figures["raw_s"]
                figures["ratio"] = figures["raw_s"] / figures["move_s"]
                rounds.append(figures)
                print(f"copy round {r + 1} (shard {shard}, {args.copy_cells} cells): move "
                      f"{figures['move_cells_per_s']:.0f} cells/s, raw {figures['raw_cells_per_s']:.0f} cells/s, "
                      f"ratio {figures['ratio']:.2f}", file=sys.stderr, flush=True)
            src.close()
            dst.close()
            return {"cells": args.copy_cells, "rounds": rounds, "ratio": spread([f["ratio"] for f in rounds]),
                    "profile": profile.summary("move")}
    finally:
        nodes.close()


# -- 2. growing, 3. writers -----------------------------------------------------------------------
def step_seconds(record: JobRecord) -> list[float]:
    return [((s.finished_at or s.started_at) - s.started_at).total_seconds() if s.started_at else float("nan")
            for s in record.steps]


def grow(store: Store, nodes: Nodes, concurrency: int) -> dict[str, Any]:
    """Node c joins, a rebalance job run here moves its share and drops the source copies."""
    add_c(store, nodes)
    planned = rebalance_moves(store)
    runner = JobRunner(store, KindRegistry([Rebalance(store)]))
    record = runner.submit(KIND, job_params(planned, "bench: grow to 3 nodes"),
                           throttle=ThrottleSettings(rate=None, concurrency=concurrency))
    start = time.perf_counter()
    done = runner.run(record.id)
    wall = time.perf_counter() - start
    assert done.state == "done", done.error
    moved = sum(m.weight for m in planned.moves)
    moves_s, drop_s = step_seconds(done)
    settle = 2 * store.options.map_refresh
    return {"moves": len(planned.moves), "cells_moved": moved, "job_s": wall, "moves_step_s": moves_s,
            "drop_step_s": drop_s, "drop_settle_s": settle, "moves_cells_per_s": moved / moves_s,
            "drop_cells_per_s": moved / max(drop_s - settle, 1e-9), "before": planned.before, "after": planned.after,
            "fenced_ms": fenced_of(done)}


def fenced_of(record: JobRecord) -> dict[str, float]:
    cursor = record.steps[0].cursor if isinstance(record.steps[0].cursor, dict) else {}
    fenced = [float(v["fenced_ms"]) for v in cursor.get("shards", {}).values() if "fenced_ms" in v]
    if not fenced:
        return {}
    return {"moves": len(fenced), "p50": percentile(fenced, 0.5), "p99": p99(fenced), "max": max(fenced)}


class _FenceLog(logging.Handler):
    """Counts, per thread, the writes the store logs as having met a moved (fenced) shard."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.met: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if "reloading the shard map" in str(record.msg):
            self.met[record.thread or 0] = self.met.get(record.thread or 0, 0) + 1


class Writers:
    """Writer threads, each with its own store, paced at ``rate`` writes/s: even ones put ``batch``-cell
    batches, odd ones single cells. Each write's (wall start, seconds, kind, met a fence)."""

    def __init__(self, cluster: Path, n: int, rate: float, batch: int) -> None:
        self.samples: list[tuple[float, float, str, bool]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._fences = _FenceLog()
        store_log = logging.getLogger("logstore.store")
        store_log.addHandler(self._fences)
        store_log.setLevel(logging.INFO)
        self._threads = [threading.Thread(target=self._write, args=(cluster, i, rate, batch), name=f"writer-{i}")
                         for i in range(n)]
        for thread in self._threads:
            thread.start()

    def _write(self, cluster: Path, i: int, rate: float, batch: int) -> None:
        kind = "batch" if i % 2 == 0 else "single"
        me = threading.get_ident()
        try:
            with logstore.open(cluster) as store:
                n, due = 0, time.perf_counter()
                while not self._stop.is_set():
                    due += 1 / rate
                    if (ahead := due - time.perf_counter()) > 0:
                        time.sleep(ahead)
                    elif ahead < -1:
                        due = time.perf_counter()  # far behind: no burst to catch up
                    met = self._fences.met.get(me, 0)
                    wall, start = time.time(), time.perf_counter()
                    if kind == "batch":
                        store.put_cells([(uuid.uuid4(), "W", n, trip_body(n + j)) for j in range(batch)])
                    else:
                        store.put_cell(uuid.uuid4(), "W", n, trip_body(n))
                    spent = time.perf_counter() - start
                    with self._lock:
                        self.samples.append((wall, spent, kind, self._fences.met.get(me, 0) != met))
                    n += 1
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        logging.getLogger("logstore.store").removeHandler(self._fences)
        if self.errors:
            raise self.errors[0]

    def window(self, windows: list[tuple[float, float]], kind: str | None = None) -> list[float]:
        """The latencies of the writes of ``kind`` (None: all) started within one of ``windows``."""
        with self._lock:
            return [s for at, s, k, _ in self.samples if kind in (None, k) and any(a <= at < b for a, b in windows)]

    def fenced(self, windows: list[tuple[float, float]]) -> list[float]:
        with self._lock:
            return [s for at, s, _, met in self.samples if met and any(a <= at < b for a, b in windows)]


def backoffs(log: str) -> dict[str, Any]:
    """The throttle's back-offs in a job's log (``--verbose``): how many, seconds in all, the reasons."""
    found = re.findall(r"throttle: goes on after backing off ([0-9.]+) s \((.*)\)", log)
    reasons: dict[str, int] = {}
    for _, why in found:
        reason = re.sub(r"[0-9.]+", "N", why)
        reasons[reason] = reasons.get(reason, 0) + 1
    return {"count": len(found), "seconds": sum(float(s) for s, _ in found), "reasons": reasons}


def cli(args: argparse.Namespace, *words: str) -> list[str]:
    command = [sys.executable, "-m", "cellstream", *words]
    return ["nice", "-n", str(args.nice), *command] if args.nice else command


def drain_under_writers(args: argparse.Namespace, store: Store, nodes: Nodes) -> dict[str, Any]:
    """Writers quiet, then while ``cellstream nodes drain c --rate`` runs in processes of its own: ``--on``
    seconds running, ``--off`` seconds paused (``jobs pause``: the move under way ends first), again and again,
    so that quiet windows are spread over the job (the other load of a shared machine drifts); quiet again."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    store_arg = ["--store", str(nodes.cluster)]
    jobs = JobStore(store)
    quiet: list[tuple[float, float]] = []
    busy: list[tuple[float, float]] = []
    log: list[str] = []
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    writers = Writers(nodes.cluster, args.writers, args.write_rate, args.batch)
    try:
        time.sleep(2)  # the writers' stores opened and warm: not measured
        quiet.append((time.time(), time.time() + args.baseline))
        time.sleep(args.baseline)
        planned = subprocess.run(cli(args, "nodes", "drain", "c", "--rate", str(args.rate), "--nice-ratio",
                                     str(args.nice_ratio), "--detach", "--json",
                                     *store_arg), env=env, capture_output=True, text=True, check=True)
        job_id = json.loads(planned.stdout)["id"]
        while True:
            started = time.time()
            with tempfile.TemporaryFile("w+") as errors:  # not a pipe, which would fill while not read, and block
                runner = subprocess.Popen(cli(args, "jobs", "resume", job_id, "--run", "--verbose", *store_arg),
                                          env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
                # Paused only in the moves step: the drop step begins by waiting two map refreshes at each run.
                while runner.poll() is None and (time.time() < started + args.on or not args.off
                                                 or jobs.get(job_id).steps[0].state == "done"):
                    time.sleep(0.2)
                if runner.poll() is None:
                    with contextlib.suppress(JobStateError):  # done meanwhile
                        jobs.pause(job_id)  # the runner stops after the move under way, and exits
                runner.wait()
                errors.seek(0)
                log.append(errors.read())
            busy.append((started, time.time()))
            state = jobs.get(job_id).state
            if state == "done":
                break
            if state != "paused":
                raise RuntimeError(f"job {job_id} is {state}: {log[-1][-2000:]}")
            quiet.append((time.time(), time.time() + args.off))
            time.sleep(args.off)
            jobs.resume(job_id)
        quiet.append((time.time(), time.time() + args.baseline))
        time.sleep(args.baseline)
    finally:
        writers.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    record = jobs.get(job_id)
    moves_step, drop_step = record.steps
    assert moves_step.started_at and moves_step.finished_at and drop_step.finished_at
    steps = {"moves": (moves_step.started_at.timestamp(), moves_step.finished_at.timestamp()),
             "drop": (moves_step.finished_at.timestamp(), drop_step.finished_at.timestamp())}

    def within(windows: list[tuple[float, float]], step: tuple[float, float]) -> list[tuple[float, float]]:
        return [(max(a, step[0]), min(b, step[1])) for a, b in windows if min(b, step[1]) > max(a, step[0])]
    on = {name: within(busy, span) for name, span in steps.items()}
    out: dict[str, Any] = {
        "job": job_id, "runs": len(busy), "on_s": args.on, "off_s": args.off, "nice": args.nice,
        "nice_ratio": args.nice_ratio,
        "cpu_s": after.ru_utime - cpu.ru_utime + after.ru_stime - cpu.ru_stime,
        "busy_s": sum(b - a for a, b in busy), "quiet_s": sum(b - a for a, b in quiet),
        "moves_step_s": sum(b - a for a, b in on["moves"]), "drop_step_s": sum(b - a for a, b in on["drop"]),
        "moves": len(record.params["moves"]), "cells_moved": sum(int(m["cells"]) for m in record.params["moves"]),
        "fenced_ms": fenced_of(record), "backoff": backoffs("\n".join(log))}
    for kind in ("batch", "single", None):
        windows = {"quiet": writers.window(quiet, kind), "moves": writers.window(on["moves"], kind),
                   "drop": writers.window(on["drop"], kind)}
        windows["job"] = windows["moves"] + windows["drop"]
        out[kind or "all"] = {
            **{f"{name}_p99_ms": 1000 * p99(samples) for name, samples in windows.items()},
            **{f"{name}_p50_ms": 1000 * percentile(samples, 0.5) for name, samples in windows.items()},
            **{f"{name}_writes": len(samples) for name, samples in windows.items()},
            **{f"ratio_p99_{name}": p99(windows[name]) / p99(windows["quiet"]) for name in ("moves", "drop", "job")}}
    met = writers.fenced(busy)
    out["writes_met_fence"] = {"writes": len(met), "p50_ms": 1000 * percentile(met, 0.5) if met else None,
                               "p99_ms": 1000 * p99(met) if met else None,
                               "max_ms": 1000 * max(met) if met else None}
    if args.samples:
        Path(args.samples).write_text(json.dumps({"samples": writers.samples, "quiet": quiet, "busy": busy,
                                                  "steps": steps}))
    return out


def grow_and_drain(args: argparse.Namespace, profile: MoveProfile) -> dict[str, Any]:
    nodes = Nodes(args.server, "gr", args.shards)
    try:
        with logstore.open(nodes.cluster) as store:
            rate = seed(store, args.cells)
            print(f"seeded {args.cells} cells over {args.shards} shards at {rate:.0f} cells/s", file=sys.stderr,
                  flush=True)
            profile.reset()
            grown = grow(store, nodes, args.concurrency)
            grown["profile"] = {op: profile.summary(op) for op in ("move", "drop")}
            print(f"grown to 3 nodes: {grown['moves']} moves, {grown['cells_moved']} cells, moves step "
                  f"{grown['moves_step_s']:.1f} s, drop step {grown['drop_step_s']:.1f} s", file=sys.stderr, flush=True)
            drained = drain_under_writers(args, store, nodes)
            return {"seed_cells_per_s": rate, "grow": grown, "drain": drained}
    finally:
        nodes.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=SERVER, help="MariaDB server URL without database")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--cells", type=int, default=1_000_000, help="cells of the instance grown from 2 nodes to 3")
    parser.add_argument("--copy-cells", type=int, default=100_000, help="cells of each shard of the copy rounds")
    parser.add_argument("--copy-rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=50_000, help="the throttled rebalance's rate, cells/s")
    parser.add_argument("--concurrency", type=int, default=1, help="moves at once while growing")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--write-rate", type=float, default=100.0, help="writes/s of each writer")
    parser.add_argument("--batch", type=int, default=10, help="cells of a batched writer's put")
    parser.add_argument("--nice", type=int, default=0, help="run the throttled rebalance's process at this niceness")
    parser.add_argument("--nice-ratio", type=float, default=0.0,
                        help="the throttled rebalance's --nice-ratio (a pause after each move, R times its time)")
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds quiet before and after the job")
    parser.add_argument("--on", type=float, default=10.0, help="seconds the throttled job runs between pauses")
    parser.add_argument("--off", type=float, default=5.0, help="seconds it stays paused (0: never paused)")
    parser.add_argument("--samples", default=None, help="write every write's latency here (JSON)")
    parser.add_argument("--quick", action="store_true", help="100,000 cells, 20,000-cell copy rounds, 5 s baselines")
    parser.add_argument("--skip", default="", help="parts to leave out: copy, grow")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rebalance.json"))
    args = parser.parse_args()
    if args.quick:
        args.cells, args.copy_cells, args.copy_rounds, args.baseline = 100_000, 20_000, 2, 5.0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:  # the writers' fence counter lowers logstore.store's level
        handler.setLevel(logging.WARNING)

    profile = MoveProfile()
    profile.install()
    results: dict[str, Any] = {"shards": args.shards, "at": dt.datetime.now(dt.UTC).isoformat(),
                               "args": vars(args)}
    try:
        if "copy" not in args.skip:
            results["copy"] = copy_rate(args, profile)
        if "grow" not in args.skip:
            results.update(grow_and_drain(args, profile))
    finally:
        profile.uninstall()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    report(results, args)
    return 0


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{args.shards} shards; medians, ranges in brackets")
    if "copy" in r:
        c, rounds = r["copy"], r["copy"]["rounds"]
        ratio = c["ratio"]
        print(f"1. move copy rate, {c['cells']} cells a shard, {len(rounds)} rounds: move "
              f"{statistics.median(f['move_cells_per_s'] for f in rounds):.0f} cells/s, raw streaming copy "
              f"{statistics.median(f['raw_cells_per_s'] for f in rounds):.0f} cells/s; ratio {ratio['median']:.2f} "
              f"[{ratio['min']:.2f}-{ratio['max']:.2f}] target >= {COPY_TARGET}: "
              f"{verdict(ratio['median'] >= COPY_TARGET)}")
        print_profile("those moves", c["profile"])
    if "drain" in r:
        d = r["drain"]
        b = d["backoff"]
        print(f"\n2. {args.writers} writers ({args.write_rate:g} writes/s each) while `nodes drain c --rate "
              f"{args.rate} --nice-ratio {args.nice_ratio:g}` runs ({d['moves']} moves, {d['cells_moved']} cells) "
              f"{d['on_s']:g} s on, {d['off_s']:g} s "
              f"paused, {d['runs']} runs: moves step {d['moves_step_s']:.1f} s, drop step {d['drop_step_s']:.1f} s "
              f"running, {d['quiet_s']:.0f} s quiet in all; {b['count']} back-offs, {b['seconds']:.1f} s; the job's "
              f"processes used {d['cpu_s']:.0f} s of CPU{', nice ' + str(d['nice']) if d['nice'] else ''}")
        print("   write latency, ms: p99 (p50) quiet | moves step | drop step | whole job; ratio of p99s to quiet's")
        for kind in ("batch", "single", "all"):
            w = d[kind]
            print(f"   {kind:6s} " + " | ".join(f"{w[f'{n}_p99_ms']:.1f} ({w[f'{n}_p50_ms']:.1f})"
                                             for n in ("quiet", "moves", "drop", "job"))
                  + f"; ratios {w['ratio_p99_moves']:.2f} | {w['ratio_p99_drop']:.2f} | {w['ratio_p99_job']:.2f} "
                  f"({w['quiet_writes']} quiet, {w['job_writes']} job writes) target <= {P99_TARGET} over the job: "
                  f"{verdict(w['ratio_p99_job'] <= P99_TARGET)}")
        fenced, met = d["fenced_ms"], d["writes_met_fence"]
        if fenced:
            print(f"   writes fenced per move (MoveReport.fenced_seconds): p50 {fenced['p50']:.1f} ms, p99 "
                  f"{fenced['p99']:.1f} ms, max {fenced['max']:.1f} ms target p99 <= {FENCED_TARGET_MS:g} ms: "
                  f"{verdict(fenced['p99'] <= FENCED_TARGET_MS)}")
        if met["writes"]:
            print(f"   writes that met a fence or a moved shard: {met['writes']}, p50 {met['p50_ms']:.1f} ms, p99 "
                  f"{met['p99_ms']:.1f} ms, max {met['max_ms']:.1f} ms target p99 <= {FENCED_TARGET_MS:g} ms: "
                  f"{verdict(met['p99_ms'] <= FENCED_TARGET_MS)}")
    if "grow" in r:
        g = r["grow"]
        print(f"\n3. 2 -> 3 nodes, {args.cells} cells: {g['moves']} moves, {g['cells_moved']} cells; moves step "
              f"{g['moves_step_s']:.1f} s ({g['moves_cells_per_s']:.0f} cells/s, "
              f"{1000 * g['moves_step_s'] / max(g['moves'], 1):.1f} ms a move), drop step {g['drop_step_s']:.1f} s "
              f"(of which {g['drop_settle_s']:.0f} s waiting two map refreshes; "
              f"{g['drop_cells_per_s']:.0f} cells/s deleted); whole job {g['job_s']:.1f} s; writes fenced per move "
              f"p99 {g['fenced_ms'].get('p99', float('nan')):.1f} ms")
        print_profile("the moves", g["profile"]["move"])
        print_profile("the drops", g["profile"]["drop"])


if __name__ == "__main__":
    sys.exit(main())
