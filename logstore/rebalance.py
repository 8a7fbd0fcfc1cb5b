"""Rebalancing as a job (``cellstream shards rebalance --apply``, ``nodes drain``, ``nodes split``): Citus's
``citus_rebalance_start`` over the job machinery (:mod:`logstore.jobs`).

A job's moves are fixed when it is submitted (:func:`rebalance_moves`, :func:`drain_moves`,
:func:`split_moves`) and run in two steps:

1. ``moves``: every move, ``concurrency`` at once, each resumable from what the two nodes record
   (:func:`logstore.backends.mysql.moves.move_shard`), so a job killed at any point goes on where it stopped.
   A pause or a cancel stops starting moves and lets the ones under way finish: every shard stays whole on
   exactly one node. A move whose node does not answer waits while the others go on, and is tried again;
   the step fails (to be resumed) only when a node stays down past ``wait_for_nodes`` seconds.
2. ``drop``: once every process has had time to read the moves (two map refreshes), the source copies are
   deleted in chunks, paced by the throttle.

Each step's cursor records each shard's state, which ``cellstream jobs show`` prints.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, ClassVar, NamedTuple

from logstore.balance import Move, plan_rebalance
from logstore.errors import ConfigurationError, InvalidArgumentError, StorageUnavailableError
from logstore.jobs.kinds import JobKind, StepContext
from logstore.jobs.records import JobRecord, StepRecord
from logstore.retry import RetryPolicy
from logstore.store import Store

logger = logging.getLogger(__name__)
KIND = "rebalance"
WAIT_FOR_NODES = 900.0  # seconds a move waits for a node that does not answer before the step fails
DROP_CHUNK = 64  # source copies dropped a call (a progress report, a pause or cancel seen, after each)
_PROBE = RetryPolicy(deadline=1.0)
_OVER = ("done", "skipped")  # a move skipped: its shard went elsewhere by hand, or was on the target already


WEIGHTS = ("cells", "bytes", "writes")  # what a plan evens out: log length, stored bytes, recent writes


class Planned(NamedTuple):
    """The moves of a job and what they do to the nodes' weights (``by``: cells, bytes or recent writes);
    ``cells``: each moved shard's cells, what its copy costs."""

    moves: list[Move]
    before: dict[str, int]
    after: dict[str, int]
    by: str = "cells"
    cells: dict[int, int] = {}


def _stats(store: Store, by: str, window: float) -> tuple[list[tuple[int, str, int]], dict[int, int]]:
    """(shard, node, weight) of every shard, and every shard's cells."""
    weights = store.shard_weights(by, window=window)
    cells = weights if by == "cells" else store.cell_counts()
    node_of = store.placement()
    return [(s, node_of[s], weights[s]) for s in range(store.shard_count)], cells


def _check_grows(store: Store) -> None:
    if len(store.shard_map.live) < 2:
        raise ConfigurationError("this store has one storage node: there is nothing to rebalance (SQLite is a "
                                 "single-node embedded store; add MySQL/MariaDB nodes with `cellstream nodes add`)")


def rebalance_moves(store: Store, *, away: Sequence[str] = (), max_moves: int | None = None, by: str = "cells",
                    window: float = 3600.0) -> Planned:
    """The fewest moves that even out the active nodes by ``by`` (cells, bytes, or cells written in the last
    ``window`` seconds), every shard of ``away`` and of draining nodes moved off.

    Raises:
        ConfigurationError: a single-node store.
        InvalidArgumentError: a node of ``away`` that is not in the instance, or nothing left to move to.
    """
    _check_grows(store)
    live = {n.name: n for n in store.shard_map.live}
    for name in away:
        if name not in live:
            raise InvalidArgumentError(f"no storage node {name!r} in the instance (nodes: {', '.join(live)})")
    leaving = sorted({*away, *(n for n, e in live.items() if e.state == "draining")})
    kept = [n for n in live if n not in leaving]
    if not kept:
        raise InvalidArgumentError("every node would be drained: no node is left to hold the shards")
    stats, cells = _stats(store, by, window)
    plan = plan_rebalance(stats, kept, away=leaving, max_moves=max_moves)
    return Planned(plan.moves, plan.before, plan.after, by, {m.shard: cells[m.shard] for m in plan.moves})


def split_moves(store: Store, name: str, into: str, *, by: str = "cells", window: float = 3600.0) -> Planned:
    """Half of node ``name``'s shards (by ``by``, as :func:`rebalance_moves`; the heaviest first, each to the
    lighter half) moved to node ``into``, which holds none yet (Schemaless's way to grow: split each node in two).

    Raises:
        InvalidArgumentError: either node is not in the instance, or ``into`` holds shards already.
    """
    _check_grows(store)
    live = {n.name for n in store.shard_map.live}
    for node in (name, into):
        if node not in live:
            raise InvalidArgumentError(f"no storage node {node!r} in the instance (add it first: "
                                       f"cellstream nodes add {node} URL)" if node == into else
                                       f"no storage node {node!r} in the instance")
    stats, cells = _stats(store, by, window)
    if any(node == into for _, node, _ in stats):
        raise InvalidArgumentError(f"node {into} holds shards already: a split moves shards to an empty node")
    mine = sorted(((weight, shard) for shard, node, weight in stats if node == name), key=lambda x: (-x[0], x[1]))
    given, kept, moves, staying = 0, 0, list[Move](), 0
    for weight, shard in mine:  # heaviest first, each to the lighter half (by weight, then by shards)
        if (given, len(moves)) < (kept, staying):
            moves.append(Move(shard, name, into, weight))
            given += weight
        else:
            kept, staying = kept + weight, staying + 1
    before = {n: sum(c for _, node, c in stats if node == n) for n in live}
    after = dict(before)
    after[name], after[into] = before[name] - given, before[into] + given
    return Planned(sorted(moves, key=lambda m: m.shard), before, after, by, {m.shard: cells[m.shard] for m in moves})


def job_params(planned: Planned, purpose: str, *, wait_for_nodes: float = WAIT_FOR_NODES) -> dict[str, Any]:
    """The ``params`` of a rebalance job running ``planned``'s moves."""
    return {"purpose": purpose, "wait_for_nodes": wait_for_nodes, "by": planned.by,
            "moves": [{"shard": m.shard, "source": m.source, "target": m.target,
                       "cells": planned.cells.get(m.shard, m.weight), "weight": m.weight} for m in planned.moves]}


class _Progress:
    """The moves step's cursor: each shard's state, the cells copied, and the nodes that do not answer."""

    def __init__(self, cursor: Any) -> None:
        doc = cursor if isinstance(cursor, dict) else {}
        self.shards: dict[str, dict[str, Any]] = dict(doc.get("shards", {}))
        self.down: dict[str, str] = {}
        self._lock = threading.Lock()

    def doc(self) -> dict[str, Any]:
        with self._lock:
            return {"shards": {k: dict(v) for k, v in self.shards.items()}, "down": dict(self.down)}

    def state(self, shard: int) -> str | None:
        with self._lock:
            return self.shards.get(str(shard), {}).get("state")

    def set(self, shard: int, **fields: Any) -> None:
        with self._lock:
            self.shards[str(shard)] = {**self.shards.get(str(shard), {}), **fields}

    def cells(self) -> int:
        with self._lock:
            return sum(int(v.get("cells", 0)) for v in self.shards.values())


class Rebalance(JobKind):
    """The ``rebalance`` job kind (see the module docstring). Parameters: ``moves`` (``shard``, ``source``,
    ``target``, ``cells``), ``purpose`` (what ``jobs show`` says it is for), ``wait_for_nodes`` (seconds)."""

    name: ClassVar[str] = KIND
    unit: ClassVar[str] = "cells"

    def __init__(self, store: Store) -> None:
        self._store = store

    def plan(self, params: dict[str, Any]) -> list[StepRecord]:
        moves = params.get("moves")
        if not isinstance(moves, list) or not moves:
            raise InvalidArgumentError("a rebalance job needs a list of moves")
        shards = [int(m["shard"]) for m in moves]
        total = sum(int(m.get("cells", 0)) for m in moves)
        return [StepRecord(name=f"move {len(moves)} shards", params={}, total=total),
                StepRecord(name="drop the source copies", params={"shards": shards}, total=len(shards))]

    def describe(self, record: JobRecord) -> str:
        moves = record.params.get("moves", [])
        by = record.params.get("by", "cells")
        return f"{record.params.get('purpose', 'rebalance')}: {len(moves)} shard moves (weighed by {by})"

    def details(self, record: JobRecord) -> list[str]:
        """Shards by state, the nodes that do not answer, and each shard under way or waiting."""
        cursor = record.steps[0].cursor if record.steps and isinstance(record.steps[0].cursor, dict) else {}
        shards: dict[str, dict[str, Any]] = cursor.get("shards", {})
        planned = {str(m["shard"]): m for m in record.params.get("moves", [])}
        states: dict[str, int] = {}
        for shard in planned:
            state = shards.get(shard, {}).get("state", "planned")
            states[state] = states.get(state, 0) + 1
        lines = ["shards: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))]
        lines += [f"node {name} does not answer: {why}" for name, why in sorted(cursor.get("down", {}).items())]
        for shard, found in sorted(shards.items(), key=lambda item: int(item[0])):
            if found.get("state") in ("moving", "waiting"):
                move = planned.get(shard, {})
                lines.append(f"shard {shard} {move.get('source')} -> {move.get('target')}: {found['state']}, "
                             f"{found.get('cells', 0)}/{move.get('cells', '?')} cells"
                             + (f" ({found['error']})" if found.get("error") else ""))
        return lines

    def run_step(self, step: StepRecord, context: StepContext) -> None:
        if step.name.startswith("move"):
            self._moves(step, context)
        else:
            self._drop(step, context)

    # -- step 1 ----------------------------------------------------------------
    def _moves(self, step: StepRecord, context: StepContext) -> None:
        from logstore.backends.mysql.moves import move_shard

        params = context.job.params
        moves: list[dict[str, Any]] = list(params["moves"])
        progress = _Progress(context.cursor)
        total = step.total
        give_up = time.monotonic() + float(params.get("wait_for_nodes", WAIT_FOR_NODES))
        stopping = threading.Event()

        def one(move: dict[str, Any]) -> None:
            shard, target = int(move["shard"]), str(move["target"])
            if stopping.is_set():
                return
            if down := [n for n in (str(move["source"]), target) if n in progress.down]:
                progress.set(shard, state="waiting", error=f"node {down[0]} does not answer")
                return  # found down by another move of this pass: tried again at the next
            progress.set(shard, state="moving", target=target, error=None)
            nodes = [str(move["source"]), target]

            def pace(rows: int) -> None:  # the rate, and a back-off while either node's replicas lag or it slows
                context.throttle.wait(rows, nodes=nodes)
            try:
                report = move_shard(self._store, shard, target, pace=pace,
                                    progress=lambda _shard, copied: progress.set(shard, cells=copied))
            except InvalidArgumentError as exc:  # moved elsewhere by hand meanwhile, or there already
                progress.set(shard, state="skipped", error=str(exc))
                return
            except StorageUnavailableError as exc:
                for name in (str(move["source"]), target):
                    if (why := self._down(name)) is not None:
                        progress.down[name] = why
                progress.set(shard, state="waiting", error=str(exc))
                return
            progress.set(shard, state="done", cells=report.cells, fenced_ms=round(report.fenced_seconds * 1000, 1),
                         source=report.source)

        while True:
            todo = [m for m in moves if progress.state(int(m["shard"])) not in _OVER]
            if not todo:
                context.progress(max(progress.cells(), total or 0), max(progress.cells(), total or 0),
                                 cursor=progress.doc())
                return
            progress.down = {n: why for n in progress.down if (why := self._down(n)) is not None}
            runnable = [m for m in todo if m["source"] not in progress.down and m["target"] not in progress.down]
            for m in todo:
                if m not in runnable:
                    progress.set(int(m["shard"]), state="waiting",
                                 error=f"node {m['source'] if m['source'] in progress.down else m['target']} "
                                       "does not answer")
            self._run_all(runnable, one, context, progress, stopping, total)
            if all(progress.state(int(m["shard"])) in _OVER for m in moves):
                continue
            if time.monotonic() > give_up:
                waiting = [int(m["shard"]) for m in moves if progress.state(int(m["shard"])) not in _OVER]
                raise StorageUnavailableError(
                    f"{len(waiting)} moves wait for nodes that do not answer "
                    f"({', '.join(f'{n}: {why}' for n, why in sorted(progress.down.items())) or 'see the cursor'})")
            for _ in range(50):  # 5 s between passes over the waiting moves; a pause or cancel seen meanwhile
                context.progress(progress.cells(), total, cursor=progress.doc())
                time.sleep(0.1)

    def _run_all(self, runnable: list[dict[str, Any]], one: Any, context: StepContext, progress: _Progress,
                 stopping: threading.Event, total: int | None) -> None:
        """Run ``runnable`` moves, ``concurrency`` at once, reporting progress every second; a pause or a cancel
        stops starting moves and waits for the ones under way."""
        if not runnable:
            return
        queue = list(runnable)
        running: set[Future[None]] = set()
        with ThreadPoolExecutor(max(1, context.throttle.concurrency), thread_name_prefix="move") as pool:
            try:
                while queue or running:
                    while queue and len(running) < max(1, context.throttle.concurrency):
                        running.add(pool.submit(one, queue.pop(0)))
                    finished, running = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                    for future in finished:
                        future.result()
                    context.progress(progress.cells(), total, cursor=progress.doc())
            except BaseException:
                stopping.set()  # the moves under way finish; none starts
                for future in running:
                    future.exception()
                # The cursor as the moves left it; this report raises the stop signal again, which is let go
                # quietly: the one being raised goes on.
                with contextlib.suppress(BaseException):
                    context.progress(progress.cells(), total, cursor=progress.doc())
                raise

    def _down(self, name: str) -> str | None:
        """Why node ``name`` does not answer now (None: it does)."""
        recorder = self._store.node_recorder(name)
        if recorder is None:
            return "not open in this process"
        try:
            recorder.read_meta(_PROBE)
        except StorageUnavailableError as exc:
            return str(exc)
        return None

    # -- step 2 ----------------------------------------------------------------
    def _drop(self, step: StepRecord, context: StepContext) -> None:
        from logstore.backends.mysql.moves import drop_moved

        done = set(context.cursor or [])
        # Every process reads the map within map_refresh: after two, none reads a source copy any more.
        settle = time.monotonic() + 2 * self._store.options.map_refresh
        while time.monotonic() < settle:
            context.progress(len(done), step.total, cursor=sorted(done))
            time.sleep(0.1)
        sources = {int(m["shard"]): str(m["source"]) for m in context.job.params["moves"]}
        by_source: dict[str, list[int]] = {}
        for shard in step.params["shards"]:
            if shard not in done:
                by_source.setdefault(sources.get(shard, ""), []).append(shard)
        # A call per chunk of one source's shards: each call reads the shard map afresh (two statements a node),
        # which was half of a drop's time at a call per shard.
        chunks = [(source, found[i:i + DROP_CHUNK]) for source, found in sorted(by_source.items())
                  for i in range(0, len(found), DROP_CHUNK)]
        for source, shards in chunks:
            def pace(rows: int, nodes: tuple[str, ...] = (source,) if source else ()) -> None:
                context.throttle.wait(rows, nodes=nodes)
            try:
                drop_moved(self._store, shards, pace=pace)
            except InvalidArgumentError:
                # A shard with no source copy (dropped by an earlier run, or its move skipped) stops the call
                # where it stands: the chunk again a shard at a time, past those.
                for shard in shards:
                    with contextlib.suppress(InvalidArgumentError):
                        drop_moved(self._store, [shard], pace=pace)
            done.update(shards)
            context.progress(len(done), step.total, cursor=sorted(done))
