"""Online shard moves between two MariaDB storage nodes (`cellstream shards move`), under concurrent writes
from two stores (two worker nodes): no acknowledged cell is lost, added_ids are kept (a tailer's location stays
valid), every store follows the move, the source copy stays until dropped, and a store that has not read the
move yet meets the fence and goes where the shard went."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest

import logstore
from cellstream.cli.main import main
from logstore.backends.mysql import moves
from logstore.backends.mysql.moves import PendingMove, abort_move, drop_moved, move_shard, pending_moves
from logstore.backends.mysql.recorder import MySQLRecorder
from tests.harness.stores import two_nodes

SHARDS = 4096  # the default: moves, fences and maps at the shard count users get
ON_B = SHARDS - 1  # a shard node b holds from the start


def cluster_file(tmp_path: Path, a: str, b: str) -> Path:
    return two_nodes(tmp_path / "cluster.toml", [a, b], SHARDS)


def connect(url: str) -> pymysql.connections.Connection[Any]:
    """A connection of its own to a node's database, autocommit."""
    parts = urlsplit(url)
    return pymysql.connect(host=parts.hostname, port=parts.port or 3306, user=parts.username,
                           password=parts.password or "", database=parts.path.lstrip("/"), autocommit=True)


def scalar(url: str, sql: str) -> int:
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            [[value]] = cur.fetchall()
            return int(value)
    finally:
        conn.close()


def rows_in(url: str, shard: int) -> int:
    return scalar(url, f"SELECT COUNT(*) FROM cells WHERE shard = {shard}")


def max_id(url: str, shard: int) -> int:
    return scalar(url, f"SELECT COALESCE(MAX(added_id), 0) FROM cells WHERE shard = {shard}")


def keys_in(store: logstore.Store, shard: int) -> Any:
    return (k for k in iter(uuid.uuid4, None) if store.shard_of(k) == shard)


def full_log(store: logstore.Store, shard: int) -> list[logstore.Cell]:
    cells, location = [], 0
    while page := store.get_cells_for_shard(shard, location, 500)[0]:
        cells.extend(page)
        location = page[-1].added_id
    return cells


def test_shards_move_online_under_writes_and_every_store_follows(
        mysql_database_factory: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    mover = logstore.open(cluster, map_refresh=0.5)
    other = logstore.open(cluster, map_refresh=0.5)  # a second worker node
    stale = logstore.open(cluster, map_refresh=3600)  # one that will not read the move by itself
    try:
        first = mover.put_cells([(k, "BASE", 1, {"before": n}) for n, k in
                                 enumerate(itertools.islice(keys_in(mover, 1), 150))])
        before = full_log(mover, 1)
        assert [c.added_id for c in before] == [c.added_id for c in first]

        acked: list[logstore.Cell] = []
        errors: list[BaseException] = []
        writing = threading.Event()
        writing.set()

        def write(store: logstore.Store, shard: int) -> None:
            for n, key in enumerate(keys_in(store, shard)):
                if not writing.is_set():
                    return
                try:
                    acked.append(store.put_cell(key, "BASE", 1, {"during": n}))
                except logstore.LogstoreError as exc:
                    errors.append(exc)

        writers = [threading.Thread(target=write, args=(s, shard)) for s in (mover, other) for shard in (1, 2, ON_B)]
        for writer in writers:
            writer.start()
        time.sleep(0.5)
        capsys.readouterr()
        assert main(["shards", "move", "1", "2", "--to", "b", "--store", str(cluster), "--json"]) == 0
        reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        time.sleep(0.8)
        writing.clear()
        for writer in writers:
            writer.join(60)
        assert not errors, errors[:3]
        assert [(r["shard"], r["source"], r["target"]) for r in reports] == [(1, "a", "b"), (2, "a", "b")]
        assert all(r["fenced_seconds"] < 5 for r in reports)

        with logstore.open(cluster) as fresh:
            assert (fresh.node_of(1), fresh.node_of(2), fresh.node_of(ON_B)) == ("b", "b", "b")
            assert fresh.node_of(0) == "a"
            for cell in [*first, *acked]:  # every acknowledged cell is there
                stored = fresh.get_cell(cell.row_key, "BASE", 1)
                assert stored is not None and stored.body == cell.body
            for shard in (1, 2):
                log = full_log(fresh, shard)
                ids = [c.added_id for c in log]
                assert ids == sorted(set(ids))  # one log, increasing
                assert {c.row_key for c in log} == {c.row_key for c in [*first, *acked] if c.shard == shard}
                for cell in acked:  # what writers saw acknowledged, they see at the same place
                    if cell.shard == shard:
                        assert cell in log
            assert full_log(fresh, 1)[:len(before)] == before  # same added_ids: tailer locations stay valid
            assert mover.node_of(1) == other.node_of(1) == "b"
            assert any(c.shard in (1, 2) and c.added_id > before[-1].added_id for c in acked)

        kept = rows_in(a, 1)  # the source copy stays, fenced, until dropped
        assert kept >= len(before) and kept == len([c for c in full_log(mover, 1) if c.added_id <= max_id(a, 1)])
        assert main(["shards", "drop-moved", "1", "--store", str(cluster)]) == 0
        assert rows_in(a, 1) == 0

        # The stale store still routes shard 1 to node a: the fence sends its write where the shard went.
        key = next(keys_in(stale, 1))
        late = stale.put_cell(key, "BASE", 1, {"from": "a stale map"})
        assert stale.node_of(1) == "b" and rows_in(a, 1) == 0
        with logstore.open(cluster) as fresh:
            assert fresh.get_cell(key, "BASE", 1) == late
    finally:
        for store in (mover, other, stale):
            store.close()



@pytest.mark.parametrize(("argv", "message"), [
    (["shards", "move", "1", "--to", "nowhere"], "no storage node 'nowhere'"),
    (["shards", "move", str(ON_B), "--to", "b"], f"shard {ON_B} is on node b already"),
    (["shards", "move", "4096", "--to", "b"], "shard must be an integer in [0, 4096)"),
    (["shards", "drop-moved", "1"], "shard 1 was not moved"),
])
def test_bad_moves_are_refused_with_one_line(mysql_database_factory: Any, tmp_path: Path, argv: list[str],
                                             message: str, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = cluster_file(tmp_path, mysql_database_factory(), mysql_database_factory())
    with logstore.open(cluster):
        pass
    capsys.readouterr()
    assert main([*argv, "--store", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


# -- resumable moves (issue 51) ---------------------------------------------------------------------------
# A move's process SIGKILLed at a step (its own step hook kills it there), then the move resumed from what the two
# nodes record: the phase the nodes show, and the phase the resumed move reports it found.
KILL = """
import os, signal, sys
import logstore
from logstore.backends.mysql import moves
moves.PAGE = 40  # several pages of a few hundred cells
moves.step_hook = lambda step: os.kill(os.getpid(), signal.SIGKILL) if step == sys.argv[2] else None
with logstore.open(sys.argv[1]) as store:
    moves.move_shard(store, 1, "b")
sys.exit(3)
"""
STEPS = {"prepared": ("copying", "copying"), "page": ("copying", "copying"), "prechecked": ("copying", "copying"),
         "fenced": ("fenced", "fenced"), "copied": ("fenced", "fenced"), "checked": ("fenced", "fenced"),
         "carried": ("fenced", "fenced"), "switched": ("switched", "switched"), "recorded": (None, "moved")}


def killed_at(cluster: Path, step: str) -> None:
    """Run a move of shard 1 to node b in another process, SIGKILLed at ``step``."""
    done = subprocess.run([sys.executable, "-c", KILL, str(cluster), step], cwd=Path(__file__).parents[2],
                          timeout=120, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]


def row_of(url: str, shard: int) -> tuple[Any, ...]:
    """(last_id, fence, moved_to, moved_at is set) of the shard's row on a node."""
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT last_id, fence, moved_to, moved_at IS NOT NULL FROM cellstream_shards WHERE shard = %s",
                        (shard,))
            [found] = cur.fetchall()
            return tuple(found)
    finally:
        conn.close()


def execute(url: str, sql: str) -> int:
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            return int(cur.execute(sql))
    finally:
        conn.close()


class Writers:
    """Threads writing cells of ``shards`` until stopped; the cells acknowledged, and any error."""

    def __init__(self, store: logstore.Store, shards: tuple[int, ...] = (1, 1)) -> None:
        self.acked: list[logstore.Cell] = []
        self.errors: list[BaseException] = []
        self._going = threading.Event()
        self._going.set()
        # Daemons: a failing test is not held up by them.
        self._threads = [threading.Thread(target=self._write, args=(store, shard), daemon=True) for shard in shards]
        for thread in self._threads:
            thread.start()

    def _write(self, store: logstore.Store, shard: int) -> None:
        for n, key in enumerate(keys_in(store, shard)):
            if not self._going.is_set():
                return
            try:
                self.acked.append(store.put_cell(key, "BASE", 1, {"during": n}))
            except logstore.LogstoreError as exc:
                self.errors.append(exc)

    def stop(self) -> list[logstore.Cell]:
        time.sleep(0.3)  # some writes after the move
        self._going.clear()
        for thread in self._threads:
            thread.join(60)
        assert not self.errors, self.errors[:3]
        return self.acked


def node(store: logstore.Store, name: str) -> MySQLRecorder:
    recorder = store.node_recorder(name)
    assert isinstance(recorder, MySQLRecorder)
    return recorder


def assert_whole_on_b(cluster: Path, a: str, b: str, written: list[logstore.Cell], shard: int = 1) -> None:
    """Every acknowledged cell of the shard once in b's log, with its added_id, the ids dense; after the source
    copy is dropped, none on a."""
    with logstore.open(cluster) as fresh:
        assert fresh.node_of(shard) == "b"
        log = full_log(fresh, shard)
        assert [c.added_id for c in log] == list(range(1, len(log) + 1))  # each id once, none skipped
        assert rows_in(b, shard) == len(log)
        mine = [c for c in written if c.shard == shard]
        by_key = {c.row_key: c for c in log}
        assert len(by_key) == len(log) and set(by_key) == {c.row_key for c in mine}
        assert all(by_key[c.row_key].added_id == c.added_id and by_key[c.row_key].body == c.body for c in mine)
        assert drop_moved(fresh, [shard]) == [(shard, "a")]
    assert rows_in(a, shard) == 0 and rows_in(b, shard) == len(log)


@pytest.mark.parametrize("step", list(STEPS))
def test_a_move_killed_at_each_step_is_resumed_from_the_nodes_and_loses_nothing(
        mysql_database_factory: Any, tmp_path: Path, step: str) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    with logstore.open(cluster, map_refresh=0.5) as store:
        first = store.put_cells([(k, "BASE", 1, {"before": n}) for n, k in
                                 enumerate(itertools.islice(keys_in(store, 1), 160))])
        store.claim_offsets("app.t", "w1", [0, 1, 2])
        assert store.commit_offsets("app.t", "w1", {1: (123, {"deadlettered": 2}), 2: (7, {})}) == set()
        writers = Writers(store)
        time.sleep(0.2)
        killed_at(cluster, step)
        shown, found = STEPS[step]
        assert pending_moves(store) == ([PendingMove(1, "a", "b", shown)] if shown else [])
        report = move_shard(store, 1, "b")
        written = [*first, *writers.stop()]
        assert (report.shard, report.source, report.target, report.found) == (1, "a", "b", found)
        assert pending_moves(store) == []
        assert store.node_of(1) == "b"
        # The consumer's record of the shard went with it; the source's commits of it are refused from now on.
        carried = {r.shard: r for r in node(store, "b").read_offsets("app.t")}
        assert (carried[1].location, carried[1].owner, carried[1].doc) == (123, "w1", {"deadlettered": 2})
        assert 2 not in carried
        assert node(store, "a").commit_offsets("app.t", "w1", {1: (200, "{}")}) == {1}
        assert store.commit_offsets("app.t", "w1", {1: (200, {})}) == set()
        assert store.read_offsets("app.t")[1].location == 200
        assert report.head == max_id(a, 1) and report.cells == rows_in(a, 1)
        again = move_shard(store, 1, "b")  # idempotent: a move found done returns its report
        assert (again.found, again.head, again.cells) == ("moved", report.head, report.cells)
    assert_whole_on_b(cluster, a, b, written)


def test_abort_undoes_a_move_killed_while_fenced_and_the_shard_moves_later(
        mysql_database_factory: Any, tmp_path: Path) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    with logstore.open(cluster, map_refresh=0.5) as store:
        first = store.put_cells([(k, "BASE", 1, {"before": n}) for n, k in
                                 enumerate(itertools.islice(keys_in(store, 1), 160))])
        writers = Writers(store)
        killed_at(cluster, "copied")
        assert row_of(a, 1)[1:] == ("b", None, 0)  # fenced, writes refused
        paced: list[int] = []
        assert abort_move(store, 1, pace=paced.append) == PendingMove(1, "a", "b", "fenced")
        assert pending_moves(store) == [] and rows_in(b, 1) == 0 and sum(paced) >= 160
        assert row_of(a, 1)[1:] == (None, None, 0) and row_of(b, 1)[1:] == ("a", "a", 1)
        time.sleep(0.3)
        during = len(writers.acked)
        time.sleep(0.3)
        assert len(writers.acked) > during and store.node_of(1) == "a"  # writes go on at the source
        with pytest.raises(logstore.InvalidArgumentError, match="no move of shard 1 is under way"):
            abort_move(store, 1)
        assert move_shard(store, 1, "b").found == "new"  # a half-done move leaves a way out
        written = [*first, *writers.stop()]
    assert_whole_on_b(cluster, a, b, written)


def test_a_switched_move_cannot_be_aborted_only_finished(mysql_database_factory: Any, tmp_path: Path) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    with logstore.open(cluster, map_refresh=0.5) as store:
        first = store.put_cells([(k, "BASE", 1, {}) for k in itertools.islice(keys_in(store, 1), 50)])
        killed_at(cluster, "switched")
        with pytest.raises(logstore.InvalidArgumentError, match="switched already"):
            abort_move(store, 1)
        with pytest.raises(logstore.InvalidArgumentError, match="being moved to node b"):
            move_shard(store, 1, "a")  # back where the map still puts it: refused while the move is half done
        assert move_shard(store, 1, "b").found == "switched"
    assert_whole_on_b(cluster, a, b, first)


def test_a_copy_that_differs_from_the_source_is_refused_before_or_while_fenced(
        mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The check before the fence compares the part copied so far; the one while fenced, the rest. Either
    mismatch raises, lifts any fence and records nothing; the move can then be aborted and made again."""
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    monkeypatch.setattr(moves, "PAGE", 100)
    with logstore.open(cluster) as store:
        keys = keys_in(store, 1)
        first = store.put_cells([(next(keys), "BASE", 1, {}) for _ in range(250)])

        def lose_copied(step: str) -> None:  # a cell of the first page lost on the target
            if step == "page" and rows_in(b, 1) == 100:
                execute(b, "DELETE FROM cells WHERE shard = 1 AND added_id = 50")
        monkeypatch.setattr(moves, "step_hook", lose_copied)
        with pytest.raises(logstore.StorageError, match="nothing was fenced"):
            move_shard(store, 1, "b")
        assert row_of(a, 1)[1:] == (None, None, 0) and store.node_of(1) == "a"
        assert abort_move(store, 1).phase == "copying"

        tail: list[logstore.Cell] = []

        def lose_tail(step: str) -> None:  # written after the first check, lost on the target while fenced
            if step == "prechecked":
                tail.extend(store.put_cells([(next(keys), "BASE", 1, {"tail": n}) for n in range(3)]))
            if step == "copied":
                assert row_of(a, 1)[1] == "b"
                execute(b, f"DELETE FROM cells WHERE shard = 1 AND added_id = {tail[1].added_id}")
        monkeypatch.setattr(moves, "step_hook", lose_tail)
        with pytest.raises(logstore.StorageError, match="nothing was switched"):
            move_shard(store, 1, "b")
        assert row_of(a, 1)[1:] == (None, None, 0) and store.node_of(1) == "a"  # fence lifted, nothing recorded
        assert pending_moves(store) == [PendingMove(1, "a", "b", "copying")]
        later = store.put_cell(next(keys), "BASE", 1, {"after": "the refused move"})
        monkeypatch.setattr(moves, "step_hook", None)
        # The operator's way out: `shards moving` lists it with both commands, `shards abort-move` undoes it.
        assert main(["shards", "moving", "--store", str(cluster), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == [
            {"shard": 1, "source": "a", "target": "b", "phase": "copying"}]
        assert main(["shards", "abort-move", "1", "--store", str(cluster)]) == 0
        assert "its move from a to b is undone" in capsys.readouterr().out
        assert main(["shards", "moving", "--store", str(cluster)]) == 0
        assert capsys.readouterr().out == "no move is half done\n"
        assert move_shard(store, 1, "b").found == "new"
    assert_whole_on_b(cluster, a, b, [*first, *tail, later])


def test_offsets_are_carried_and_the_source_refuses_commits_and_claims_once_fenced(
        mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the fence on, a stale process's commit of the shard on the source is refused, and its claim waits
    for the switch and lands on the target, over the record carried there. (The shard goes from b to a: the
    record left on the source is read after the target's, and must not hide it.)"""
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    with logstore.open(cluster) as store, logstore.open(cluster, map_refresh=3600) as stale:
        store.put_cells([(k, "BASE", 1, {}) for k in itertools.islice(keys_in(store, ON_B), 20)])
        store.claim_offsets("app.t", "w1", [ON_B, ON_B - 1])
        assert store.commit_offsets("app.t", "w1", {ON_B: (11, {"n": 1}), ON_B - 1: (2, {})}) == set()
        claims: list[dict[int, logstore.OffsetRecord]] = []
        seen: dict[str, Any] = {}

        def at(step: str) -> None:
            if step == "fenced":
                seen["commit"] = stale.commit_offsets("app.t", "w1", {ON_B: (15, {}), ON_B - 1: (3, {})})
                with pytest.raises(logstore.StorageUnavailableError, match="another process is moving it"):
                    move_shard(stale, ON_B, "a")
                with pytest.raises(logstore.StorageUnavailableError, match="another process is moving it"):
                    abort_move(stale, ON_B)
            if step == "carried":  # after the offsets were carried, before the switch
                claimer.start()
                time.sleep(0.3)
                seen["claims while fenced"] = len(claims)
        claimer = threading.Thread(target=lambda: claims.append(
            stale.claim_offsets("app.t", "w2", [ON_B, ON_B - 1])))
        monkeypatch.setattr(moves, "step_hook", at)
        move_shard(store, ON_B, "a")
        claimer.join(30)
        assert seen["commit"] == {ON_B}  # the other shard committed, the moving one refused
        assert seen["claims while fenced"] == 0
        [claimed] = claims
        assert {s: (r.location, r.owner) for s, r in claimed.items()} == {ON_B: (11, "w2"), ON_B - 1: (3, "w2")}
        assert stale.node_of(ON_B) == "a"
        on_a = {r.shard: r for r in node(store, "a").read_offsets("app.t")}
        assert (on_a[ON_B].location, on_a[ON_B].owner, on_a[ON_B].doc) == (11, "w2", {"n": 1})
        assert store.commit_offsets("app.t", "w1", {ON_B: (16, {})}) == {ON_B}  # w2 holds it now
        assert store.commit_offsets("app.t", "w2", {ON_B: (16, {})}) == set()
        assert store.read_offsets("app.t")[ON_B].location == 16  # the holder's record, not the source's


def test_pace_is_given_each_page_copied_or_deleted_never_while_fenced(
        mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    monkeypatch.setattr(moves, "PAGE", 40)
    with logstore.open(cluster) as store:
        keys = keys_in(store, 1)
        store.put_cells([(next(keys), "BASE", 1, {}) for _ in range(230)])
        paced: list[tuple[int, Any]] = []

        def at(step: str) -> None:
            if step == "prechecked":
                store.put_cells([(next(keys), "BASE", 1, {}) for _ in range(5)])  # copied while fenced
        monkeypatch.setattr(moves, "step_hook", at)
        report = move_shard(store, 1, "b", pace=lambda rows: paced.append((rows, row_of(a, 1)[1])))
        assert (report.cells, report.head) == (235, 235)
        assert store.put_cell(next(keys), "BASE", 1, {}).added_id == 236  # the target counts on from the head
        assert [rows for rows, _ in paced] == [40] * 5 + [30]
        assert all(fence is None for _, fence in paced)
        paced.clear()
        drop_moved(store, [1], pace=lambda rows: paced.append((rows, None)))
        assert [rows for rows, _ in paced] == [40] * 5 + [35] and rows_in(a, 1) == 0


def test_a_shard_coming_back_to_the_node_it_left_resumes_and_aborts_through_it(
        mysql_database_factory: Any, tmp_path: Path) -> None:
    """The map reaches the shard through its home's row: while it comes back home that row leads on to the
    node holding it, an abort leaves it so, and the switch home routes writes there at once."""
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    with logstore.open(cluster, map_refresh=0.5) as store:
        first = store.put_cells([(k, "BASE", 1, {}) for k in itertools.islice(keys_in(store, 1), 120)])
        move_shard(store, 1, "b")
        drop_moved(store, [1])
        writers = Writers(store)
        for step in ("copied", "switched"):
            with_cells = rows_in(a, 1)
            (cluster.parent / "back.py").write_text(KILL.replace('"b"', '"a"'))
            done = subprocess.run([sys.executable, str(cluster.parent / "back.py"), str(cluster), step],
                                  cwd=Path(__file__).parents[2], timeout=120, capture_output=True, text=True)
            assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
            if step == "copied":
                assert with_cells == 0 and pending_moves(store) == [PendingMove(1, "b", "a", "fenced")]
                abort_move(store, 1)
                assert row_of(a, 1)[1:] == ("b", "b", 1) and rows_in(a, 1) == 0
                store.refresh_map()
                assert store.node_of(1) == "b"
                during = len(writers.acked)
                time.sleep(0.3)
                assert len(writers.acked) > during  # written on b
            else:  # switched home: the map stops at a already, b's fence unrecorded
                store.refresh_map()
                assert store.node_of(1) == "a"
                assert pending_moves(store) == [PendingMove(1, "b", "a", "switched")]
                assert move_shard(store, 1, "a").found == "switched"
        written = [*first, *writers.stop()]
        assert pending_moves(store) == [] and store.node_of(1) == "a"
        with logstore.open(cluster) as fresh:
            log = full_log(fresh, 1)
            assert [c.added_id for c in log] == list(range(1, len(log) + 1))
            assert {c.row_key for c in log} == {c.row_key for c in written}
            assert rows_in(a, 1) == len(log)


def test_a_direct_mode_app_reads_on_across_a_move_and_resumes_from_the_carried_offsets(
        mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An app reading the store directly (offsets in the store) goes on through a move of a shard it reads: its
    commits of the shard are refused while the shard is fenced and go on on the target after the switch (the
    move carried its record, naming it, there). Restarted, it resumes from there, not from its start_from."""
    from indexer import App

    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    with logstore.open(cluster, map_refresh=0.5) as store:
        keys = keys_in(store, 1)
        written = store.put_cells([(next(keys), "BASE", 1, {"n": n}) for n in range(50)])
        seen: list[logstore.Cell] = []
        held = threading.Event()
        go = threading.Event()

        def handle(cell: logstore.Cell) -> None:
            if cell.body.get("hold") and not go.is_set():
                held.set()
                go.wait(30)
            seen.append(cell)
        app = App("mover", store=store, commit_interval=0.05)
        app.trigger("BASE")(handle)
        refused: list[set[int]] = []
        commit = store.commit_offsets

        def watched(consumer: str, owner: str, offsets: Any) -> set[int]:
            out = commit(consumer, owner, offsets)
            if 1 in offsets:
                refused.append(out)
            return out
        monkeypatch.setattr(store, "commit_offsets", watched)
        running: dict[str, Any] = {}

        def serve() -> None:
            async def main() -> None:
                running["loop"], running["stop"] = asyncio.get_running_loop(), asyncio.Event()
                await app.run_async(running["stop"])
            try:
                asyncio.run(main())
            except BaseException as exc:
                running["error"] = exc
        server = threading.Thread(target=serve)
        server.start()

        def until(what: Any, timeout: float = 30) -> None:
            deadline = time.monotonic() + timeout
            while not what():
                assert "error" not in running, running.get("error")
                assert time.monotonic() < deadline, "timed out"
                time.sleep(0.02)

        def committed(shard: int) -> int | None:
            return store.read_offsets("app.mover").get(shard, logstore.OffsetRecord(shard, None, "", {})).location
        until(lambda: committed(1) == written[-1].added_id)

        def at(step: str) -> None:
            if step == "prechecked":  # cells the app holds on to until the shard is fenced
                written.extend(store.put_cells([(next(keys), "BASE", 1, {"hold": n}) for n in range(3)]))
                held.wait(30)
            if step == "fenced":
                go.set()
                until(lambda: any(1 in out for out in refused))  # the app's commit of them, refused
        monkeypatch.setattr(moves, "step_hook", at)
        move_shard(store, 1, "b")
        written.extend(store.put_cells([(next(keys), "BASE", 1, {"after": n}) for n in range(20)]))
        until(lambda: committed(1) == written[-1].added_id)  # committed on b now
        on_b = {r.shard: r for r in node(store, "b").read_offsets("app.mover")}
        assert on_b[1].location == written[-1].added_id
        assert "error" not in running and server.is_alive()  # not taken over: the app read on
        running["loop"].call_soon_threadsafe(running["stop"].set)
        server.join(30)
        assert "error" not in running, running.get("error")
        assert {c.row_key for c in seen} == {c.row_key for c in written}

        later = store.put_cells([(next(keys), "BASE", 1, {"later": n}) for n in range(5)])
        again: list[logstore.Cell] = []
        restarted = App("mover", store=store, start_from="now")  # "now" would skip the five
        restarted.trigger("BASE")(again.append)
        assert restarted.drain(30).processed == 5
        assert sorted(c.added_id for c in again) == [c.added_id for c in later]


class Stop(Exception):
    """Raised by a test's hook or pace to stop a move or an abort at a chosen point."""


def test_an_abort_stopped_midway_leaves_a_copy_a_move_goes_on_from(
        mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort deletes the partial copy from the highest added_id down: stopped after a page, what stays is
    the source's cells up to some id, which a move copies on from."""
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    monkeypatch.setattr(moves, "PAGE", 40)
    with logstore.open(cluster) as store:
        first = store.put_cells([(k, "BASE", 1, {}) for k in itertools.islice(keys_in(store, 1), 160)])

        def stop_fenced(step: str) -> None:
            if step == "checked":
                raise Stop
        monkeypatch.setattr(moves, "step_hook", stop_fenced)
        with pytest.raises(Stop):
            move_shard(store, 1, "b")
        monkeypatch.setattr(moves, "step_hook", None)
        assert rows_in(b, 1) == 160 and row_of(a, 1)[1] is None  # the failure lifted the fence

        def second_page(rows: int, paced: list[int] = []) -> None:  # noqa: B006 - counts the calls
            paced.append(rows)
            if len(paced) == 2:
                raise Stop
        with pytest.raises(Stop):
            abort_move(store, 1, pace=second_page)
        assert rows_in(b, 1) == 120 and max_id(b, 1) == 120
        assert pending_moves(store) == [PendingMove(1, "a", "b", "copying")]
        assert move_shard(store, 1, "b").found == "copying"
    assert_whole_on_b(cluster, a, b, first)
