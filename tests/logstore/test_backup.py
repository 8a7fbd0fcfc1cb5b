"""Backup and restore (logstore.backup, ``cellstream backup``/``restore``) on real backends: a backup taken
under writers restores cell for cell and id for id, an incremental chain as a full backup, ``--until`` exactly,
``--shards`` a range; a damaged backup and a non-empty target are refused with nothing written; no password is
ever in a backup."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import logstore
from cellstream.cli.main import main
from logstore.backends.mysql.recorder import MySQLRecorder
from logstore.backup.chunks import cell_file, read_cell_file
from logstore.backup.create import BackupProgress, ReadAhead, create_backup, start_backup
from logstore.backup.manifest import Manifest, backup_ids, read_manifest
from logstore.backup.restore import restore
from logstore.backup.storage import DirectoryStorage
from logstore.backup.verify import verify_chain
from logstore.errors import CorruptBackupError, RestoreTargetNotEmptyError
from logstore.log_blocks import LogBlock, encode
from logstore.persistence import RestoredCell
from tests.harness.stores import two_nodes

SHARDS = 16
CHUNK = 5  # shards a cell file: 4 files for 16 shards


@pytest.fixture(params=["sqlite", "mysql"])
def make_instance(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Path]:
    """Makes the cluster file of a new, empty two-node instance of the param's backend."""
    made = iter(range(100))
    if request.param == "mysql":
        factory = request.getfixturevalue("mysql_database_factory")

        def urls() -> list[str]:
            return [factory(), factory()]
    else:
        def urls() -> list[str]:
            return [f"sqlite:///{tmp_path}/db{next(made)}", f"sqlite:///{tmp_path}/db{next(made)}"]

    def make() -> Path:
        return two_nodes(tmp_path / f"cluster{next(made)}.toml", urls(), SHARDS)
    return make


@pytest.fixture
def sqlite_instance(tmp_path: Path) -> Callable[[], Path]:
    made = iter(range(100))

    def make() -> Path:
        n = next(made)
        return two_nodes(tmp_path / f"cluster{n}.toml", [f"sqlite:///{tmp_path}/a{n}", f"sqlite:///{tmp_path}/b{n}"],
                         SHARDS)
    return make


def write(store: logstore.Store, n: int, tag: str = "x") -> list[logstore.Cell]:
    return store.put_cells([(uuid.uuid4(), "c", 1, {"tag": tag, "i": i}) for i in range(n)])


def log(store: logstore.Store, shard: int, upto: int | None = None) -> list[logstore.Cell]:
    """The shard's cells (up to added_id ``upto``)."""
    out: list[logstore.Cell] = []
    location = 0
    while True:
        cells, location = store.get_cells_for_shard(shard, location, 1000)
        if not cells:
            return [c for c in out if upto is None or c.added_id <= upto]
        out += cells


def assert_same(source: logstore.Store, target: logstore.Store, watermarks: list[int]) -> None:
    """The target holds the source's cells up to the watermarks, the same in every field (ids included)."""
    for shard in range(SHARDS):
        assert log(target, shard) == log(source, shard, watermarks[shard]), f"shard {shard}"


class Writers:
    """Four threads writing cells (and a dead letter now and then) until stopped."""

    def __init__(self, store: logstore.Store) -> None:
        self.store = store
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.rounds = 0  # rounds done by the writers together (a round: 10 cells, every fifth a dead letter too)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(4)]

    def _run(self, i: int) -> None:
        try:
            n = 0
            while not self.stop.is_set():
                write(self.store, 10, f"w{i}")
                if n % 5 == 0:
                    self.store.put_system_cells([(uuid.uuid4(), "_dlq", 1, {"writer": i, "n": n})])
                n += 1
                self.rounds += 1
        except BaseException as exc:  # reported by the test (__exit__)
            self.errors.append(exc)

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors


def test_backup_under_writers_restores_cell_for_cell_and_id_for_id(make_instance: Callable[[], Path],
                                                                   tmp_path: Path) -> None:
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(make_instance(), shards=SHARDS) as source:
        write(source, 200)
        source.claim_offsets("app", "owner-1")
        committed = {s: (h, {"at": s}) for s, h in source.heads().items() if h}
        source.commit_offsets("app", "owner-1", committed)
        with Writers(source) as writers:
            while writers.rounds < 20 and not writers.errors:  # the writers are under way
                time.sleep(0.01)
            manifest = create_backup(source, storage, chunk_shards=CHUNK)
        heads = source.heads()
        assert any(heads[s] > manifest.watermarks[s] for s in range(SHARDS)), "writes went on past the watermarks"
        assert manifest.cells == sum(len(log(source, s, manifest.watermarks[s])) for s in range(SHARDS))
        with logstore.open(make_instance(), shards=SHARDS) as target:
            report = restore(storage, target)
            assert report.cells == manifest.cells
            assert_same(source, target, manifest.watermarks)
            assert any(c.column == "_dlq" for s in range(SHARDS) for c in log(target, s)), "dead letters restored"
            assert target.read_offsets("app") == source.read_offsets("app")
            assert target.heads() == dict(enumerate(manifest.watermarks))
            # New writes continue above the restored ids, never reusing one.
            for cell in write(target, 50):
                assert cell.added_id > manifest.watermarks[cell.shard]


def test_incremental_chain_restores_as_a_full_backup(make_instance: Callable[[], Path], tmp_path: Path) -> None:
    chained, whole = DirectoryStorage(tmp_path / "chained"), DirectoryStorage(tmp_path / "whole")
    with logstore.open(make_instance(), shards=SHARDS) as source:
        write(source, 100)
        first = create_backup(source, chained, chunk_shards=CHUNK)
        write(source, 60)
        second = create_backup(source, chained, incremental=True, chunk_shards=CHUNK)
        write(source, 40)
        third = create_backup(source, chained, incremental=True, chunk_shards=CHUNK)
        full = create_backup(source, whole, chunk_shards=CHUNK)
        assert (second.parent_id, third.parent_id) == (first.backup_id, second.backup_id)
        assert third.cells == 40 and third.watermarks == full.watermarks
        with logstore.open(make_instance(), shards=SHARDS) as a, logstore.open(make_instance(), shards=SHARDS) as b:
            assert restore(chained, a).chain == [first.backup_id, second.backup_id, third.backup_id]
            restore(whole, b)
            for shard in range(SHARDS):
                assert log(a, shard) == log(b, shard) == log(source, shard), f"shard {shard}"


def test_until_keeps_exactly_the_cells_created_up_to_then(sqlite_instance: Callable[[], Path],
                                                          tmp_path: Path) -> None:
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(sqlite_instance(), shards=SHARDS) as source:
        cells = []
        for i in range(6):
            cells += write(source, 20, f"batch{i}")
        until = sorted(c.created_at for c in cells)[len(cells) // 2]
        source.claim_offsets("app", "o")
        source.commit_offsets("app", "o", {s: (h, {}) for s, h in source.heads().items() if h})
        create_backup(source, storage, chunk_shards=CHUNK)
        with logstore.open(sqlite_instance(), shards=SHARDS) as target:
            report = restore(storage, target, until=until)
            kept = sorted((c.shard, c.added_id) for s in range(SHARDS) for c in log(target, s))
            assert kept == sorted((c.shard, c.added_id) for c in cells if c.created_at <= until)
            assert 0 < len(kept) < len(cells)
            # An offset past what a shard now holds comes back to its head: new cells there are not skipped.
            offsets = target.read_offsets("app")
            assert report.offsets_lowered > 0
            # (a shard that never had a cell has no location: the claim made it, no commit moved it)
            assert all((offsets[s].location or 0) == report.heads[s] for s in offsets)


def test_shards_restores_a_range(sqlite_instance: Callable[[], Path], tmp_path: Path) -> None:
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(sqlite_instance(), shards=SHARDS) as source:
        write(source, 200)
        manifest = create_backup(source, storage, chunk_shards=CHUNK)
        with logstore.open(sqlite_instance(), shards=SHARDS) as target:
            restore(storage, target, shards=(3, 7))
            for shard in range(SHARDS):
                want = log(source, shard, manifest.watermarks[shard]) if 3 <= shard <= 7 else []
                assert log(target, shard) == want, f"shard {shard}"


def damage(storage: DirectoryStorage, manifest: Manifest, index: int, how: str) -> str:
    """Damage the ``index``-th cell file of the backup; return its name."""
    name = f"{manifest.backup_id}/{manifest.files[index].name}"
    path = storage.root / name
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":  # the same size, one byte changed
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    else:  # a cell file that reads well, of the same size, every body changed: only its sha256 tells
        forged = cell_file([LogBlock(shard, len(cells), encode([c._replace(blob=bytes(len(c.blob))) for c in cells]))
                            for shard, cells in read_cell_file(name, data)])
        assert len(forged) == len(data) and forged != data
        path.write_bytes(forged)
    return name


@pytest.mark.parametrize("how", ["truncate", "flip", "rewrite"])
def test_a_damaged_file_is_named_by_verify_and_refused_by_restore(
        how: str, sqlite_instance: Callable[[], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(sqlite_instance(), shards=SHARDS) as source:
        write(source, 200)
        manifest = create_backup(source, storage, chunk_shards=CHUNK)
    bad = damage(storage, manifest, 2, how)  # not the first file: a restore that did not check first writes some
    _, problems = verify_chain(storage, manifest.backup_id)
    assert [p.name for p in problems] == [bad]
    assert ("truncated" in problems[0].problem) == (how == "truncate")
    assert main(["backup", "verify", str(storage.root)]) == 6
    assert bad in capsys.readouterr().err
    with logstore.open(sqlite_instance(), shards=SHARDS) as target:
        with pytest.raises(CorruptBackupError) as raised:
            restore(storage, target)
        assert raised.value.name == bad
        assert sum(target.heads().values()) == 0, "nothing restored"
    # The command checks before it opens (creates) its target: nothing of it is left.
    assert main(["restore", str(storage.root), "--to", f"sqlite:///{tmp_path}/never"]) == 6
    assert bad in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_a_non_empty_target_is_refused(sqlite_instance: Callable[[], Path], tmp_path: Path) -> None:
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(sqlite_instance(), shards=SHARDS) as source:
        write(source, 100)
        create_backup(source, storage, chunk_shards=CHUNK)
    with logstore.open(sqlite_instance(), shards=SHARDS) as target:
        [mine] = write(target, 1)
        with pytest.raises(RestoreTargetNotEmptyError):
            restore(storage, target)
        assert [log(target, s) for s in range(SHARDS)] == [[mine] if s == mine.shard else [] for s in range(SHARDS)]
    with logstore.open(sqlite_instance(), shards=SHARDS) as target:
        target.claim_offsets("someone", "o", [0])
        with pytest.raises(RestoreTargetNotEmptyError):
            restore(storage, target)
        assert sum(target.heads().values()) == 0


def test_an_interrupted_backup_resumes_with_its_watermarks(sqlite_instance: Callable[[], Path],
                                                           tmp_path: Path) -> None:
    storage = DirectoryStorage(tmp_path / "backups")

    def stop_after_first(p: BackupProgress) -> None:
        if p.shards_done == CHUNK:
            raise KeyboardInterrupt
    with logstore.open(sqlite_instance(), shards=SHARDS) as source:
        write(source, 200)
        with pytest.raises(KeyboardInterrupt):
            create_backup(source, storage, chunk_shards=CHUNK, progress=stop_after_first)
        _, [unfinished] = backup_ids(storage)
        write(source, 100)  # above the unfinished backup's watermarks: not in it
        manifest = create_backup(source, storage, chunk_shards=CHUNK)
        assert manifest.backup_id == unfinished and manifest.cells == 200
        with logstore.open(sqlite_instance(), shards=SHARDS) as target:
            restore(storage, target)
            assert_same(source, target, manifest.watermarks)


@pytest.fixture
def mysql_cluster(mysql_database_factory: Callable[[], str], tmp_path: Path) -> Iterator[Path]:
    yield two_nodes(tmp_path / "cluster.toml", [mysql_database_factory(), mysql_database_factory()], SHARDS)


def test_a_backup_holds_no_password(mysql_cluster: Path, tmp_path: Path) -> None:
    text = mysql_cluster.read_text()
    password = text.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert password and f":{password}@" in text
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(mysql_cluster, shards=SHARDS) as source:
        write(source, 50)
        create_backup(source, storage, chunk_shards=CHUNK)
    found = list(storage.root.rglob("*"))
    assert any(p.name == "state.bin" for p in found)
    for path in found:
        if path.is_file():
            data = path.read_bytes()
            plain = zlib.decompress(data) if path.name == "state.bin" else data  # cell files are not deflated
            assert f":{password}@".encode() not in plain, path
            if path.name == "state.bin":
                assert b"cellstream@127.0.0.1" in plain  # the nodes' URLs are there, without their password


def test_cli_create_list_restore(sqlite_instance: Callable[[], Path], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    cluster, dest = sqlite_instance(), str(tmp_path / "backups")
    with logstore.open(cluster, shards=SHARDS) as source:
        write(source, 100)
    assert main(["--store", str(cluster), "backup", "create", dest, "--chunk-shards", "5"]) == 0
    assert main(["--store", str(cluster), "backup", "create", dest, "--incremental"]) == 0
    assert main(["--json", "backup", "list", dest]) == 0
    listed = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"finished": true' in listed and listed.count('"backup"') == 2
    target = sqlite_instance()
    assert main(["restore", dest, "--to", str(target)]) == 0
    storage = DirectoryStorage(Path(dest))
    newest = read_manifest(storage, backup_ids(storage)[0][-1])
    with logstore.open(cluster) as source, logstore.open(target) as restored:
        for shard in range(SHARDS):
            # The backup jobs' own records (cells too) written after the watermarks are not in it.
            assert log(restored, shard) == log(source, shard, newest.watermarks[shard])
    assert main(["restore", dest, "--to", str(target)]) != 0  # not empty any more


def test_until_is_parsed_as_utc_when_naive() -> None:
    from cellstream.cli.backup import _until_arg

    assert _until_arg("2026-01-31T12:00:00") == dt.datetime(2026, 1, 31, 12, tzinfo=dt.UTC)


def test_restore_rebuilds_the_index_tables_from_the_restored_cells(sqlite_instance: Callable[[], Path],
                                                                     tmp_path: Path) -> None:
    from indexer import App
    from indexer.indexes.backfill import backfill
    from logstore.index_tables.persistence import Condition
    from tests.harness.index_support import SEED_YAML, seed, trip

    yaml_file = tmp_path / "v1.yaml"
    yaml_file.write_text(SEED_YAML)
    cluster, dest = sqlite_instance(), str(tmp_path / "backups")
    drivers = [uuid.uuid4() for _ in range(3)]
    spec = seed(1).spec
    with logstore.open(cluster, shards=SHARDS) as source:
        source.put_cells([(uuid.uuid4(), "BASE", 1, trip(d, d, i)) for d in drivers for i in range(5)])
        with App("trips", store=source, start_from="now") as app:  # keeps version 1 current from now on
            app.index(yaml_file)
            app.drain(timeout=30)
        backfill(source, "driver_partner_index", 1)
        wanted = {d: source.indexes.query(spec, [Condition("driver_partner_uuid", "=", d)]) for d in drivers}
        assert all(len(entries) == 5 for entries in wanted.values())
        offsets = source.read_offsets("trips")
    assert main(["--store", str(cluster), "backup", "create", dest]) == 0
    target = sqlite_instance()
    assert main(["restore", dest, "--to", str(target)]) == 0
    with logstore.open(target) as restored:
        assert [s.table for s in restored.indexes.specs()] == [spec.table]
        for driver, entries in wanted.items():
            assert restored.indexes.query(spec, [Condition("driver_partner_uuid", "=", driver)]) == entries
        assert restored.read_offsets("trips") == offsets  # the app that keeps the index goes on from them


def test_the_backup_job_paused_half_way_is_resumed_by_the_next_create(sqlite_instance: Callable[[], Path],
                                                                       tmp_path: Path) -> None:
    from cellstream.cli.jobs import known_kinds
    from logstore.backup.job import KIND, job_params
    from logstore.jobs import JobRecord, JobRunner, JobStore

    cluster, dest = sqlite_instance(), str(tmp_path / "backups")
    with logstore.open(cluster, shards=SHARDS) as source:
        write(source, 200)
        params = job_params(source, dest, incremental=False, chunk_shards=CHUNK)
        runner = JobRunner(source, known_kinds(source))
        record = runner.submit(KIND, params)

        def pause_after_a_file(current: JobRecord) -> None:
            if sum(s.state == "done" for s in current.steps) >= 2:  # start and one cell file
                JobStore(source).pause(current.id)
        paused = JobRunner(source, known_kinds(source), on_progress=pause_after_a_file).run(record.id)
        assert paused.state == "paused"
        storage = DirectoryStorage(Path(dest))
        assert backup_ids(storage) == ([], [params["backup_id"]])
        write(source, 50)  # above its watermarks: not in it
    assert main(["--store", str(cluster), "backup", "create", dest]) == 0
    assert backup_ids(storage) == ([params["backup_id"]], [])
    manifest = read_manifest(storage, params["backup_id"])
    with logstore.open(cluster) as source, logstore.open(sqlite_instance(), shards=SHARDS) as target:
        restore(storage, target)
        assert_same(source, target, manifest.watermarks)
        # The watermarks are the ones planned before the pause: the 50 cells written since are not in it.
        assert sum(c.column == "c" for s in range(SHARDS) for c in log(target, s)) == 200


def test_a_start_step_run_again_keeps_its_plan(sqlite_instance: Callable[[], Path], tmp_path: Path) -> None:
    from logstore.backup.create import start_backup

    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(sqlite_instance(), shards=SHARDS) as source:
        write(source, 50)
        plan = start_backup(source, storage, incremental=False, chunk_shards=CHUNK, backup_id="b1")
        write(source, 50)
        assert start_backup(source, storage, incremental=False, chunk_shards=CHUNK, backup_id="b1") == plan


def test_a_two_node_mysql_backup_restores_into_one_node(mysql_cluster: Path, mysql_database_factory: Callable[[], str],
                                                        tmp_path: Path) -> None:
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(mysql_cluster, shards=SHARDS) as source:
        write(source, 200)
        manifest = create_backup(source, storage, chunk_shards=CHUNK)
        with logstore.open(mysql_database_factory(), shards=SHARDS) as target:  # ids are per shard on MySQL
            restore(storage, target)
            assert_same(source, target, manifest.watermarks)
            assert target.cell_counts() == source.cell_counts()


def test_batches_of_one_shard_are_written_in_order_while_others_overlap(
        mysql_database_factory: Callable[[], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore writes two batches at once; a batch sharing a shard with one in flight waits for it, however
    long that one takes (here the first, held back before it starts): a shard's ids go in ascending."""
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(mysql_database_factory(), shards=SHARDS) as source:
        write(source, 80)
        create_backup(source, storage, chunk_shards=SHARDS)  # one file, one batch: every shard
        write(source, 80)
        create_backup(source, storage, incremental=True, chunk_shards=SHARDS)  # the same shards again
        real, calls = MySQLRecorder.restore_cells, []

        def held_back_first(recorder: MySQLRecorder, cells: Sequence[RestoredCell]) -> None:
            calls.append(len(cells))
            if len(calls) == 1:
                time.sleep(0.5)
            real(recorder, cells)

        monkeypatch.setattr(MySQLRecorder, "restore_cells", held_back_first)
        with logstore.open(mysql_database_factory(), shards=SHARDS) as target:
            assert restore(storage, target).cells == 160
            assert calls == [80, 80]
            for shard in range(SHARDS):
                assert log(target, shard) == log(source, shard), f"shard {shard}"


def test_read_ahead_gives_only_the_file_it_read(sqlite_instance: Callable[[], Path], tmp_path: Path) -> None:
    """What was read ahead goes to the step of that file of that backup, never to another file's or backup's
    (a runner that runs two backups, or a step skipped because its file is there, asks for another)."""
    storage = DirectoryStorage(tmp_path / "backups")
    with logstore.open(sqlite_instance(), shards=SHARDS) as store:
        write(store, 100)
        plan = start_backup(store, storage, incremental=False, chunk_shards=CHUNK)
        other = plan.model_copy(update={"backup_id": "other"})
        ahead = ReadAhead(store)
        try:
            ahead.start(plan, 5, 9)
            assert ahead.take(plan, 0, 4) is None  # another file: dropped
            assert ahead.take(plan, 5, 9) is None  # nothing is read ahead any more
            ahead.start(plan, 5, 9)
            assert ahead.take(other, 5, 9) is None
            ahead.start(plan, 5, 9)
            blocks = ahead.take(plan, 5, 9)
        finally:
            ahead.close()
        assert blocks is not None and {b.shard for b in blocks} <= set(range(5, 10))
        assert sum(b.cells for b in blocks) == sum(len(log(store, s)) for s in range(5, 10))
