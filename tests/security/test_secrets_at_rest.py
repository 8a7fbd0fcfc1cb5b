"""Issue 49, finding 8: secrets where they should not be. The files cellstream creates are its user's alone
(0600 files, 0700 folders, whatever the umask); a store's password need not be on the command line, where every
user of the machine reads it with ``ps``; data cannot forge a log record."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import re
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import logstore
from cellstream.cli import logsetup
from cellstream.cli.common import store_with_password
from cellstream.cli.main import main
from cellstream.errors import UsageError
from connectors.config import ParquetSinkConfig
from connectors.sinks.base import Position
from connectors.sinks.parquet import ParquetSink
from logstore.config import load_cluster_file, parse_node_url
from logstore.errors import ConfigFileError, InvalidArgumentError
from logstore.registry import url_password, with_password
from tailer.coordinators.local import LocalCoordinator
from tailer.interfaces import Offset
from tailer.publishers.directory import DirectoryPublisher


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a file is made 0644 and a folder 0755 unless its maker asks otherwise."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, str]:
    """The permission bits of everything under ``root`` (``root`` itself too), by path relative to its parent."""
    found = {root.name: oct(stat.S_IMODE(root.stat().st_mode))}
    for path in root.rglob("*"):
        found[str(path.relative_to(root.parent))] = oct(stat.S_IMODE(path.stat().st_mode))
    return found


def assert_private(found: dict[str, str], root: Path) -> None:
    for name, mode in found.items():
        expected = "0o700" if (root.parent / name).is_dir() else "0o600"
        assert mode == expected, f"{name} is {mode}, expected {expected}: {found}"


# -- files ----------------------------------------------------------------------------------------------------


def test_a_sqlite_store_its_wal_shm_index_file_and_folders_are_private(tmp_path: Path, umask_022: None) -> None:
    root = tmp_path / "made"  # two levels cellstream creates
    with logstore.open(f"sqlite:///{root}/store", shards=4) as store:
        store.put_cell(uuid.uuid4(), "BASE", 1, {"x": 1})
        recorder = store.node_recorder("node0")
        assert recorder is not None
        recorder.indexes.specs()  # opens (creates) indexes.db
        found = modes(root)
        # SQLite gives -wal and -shm the database file's mode: they exist while the store is open.
        assert {"made/store/logstore.db-wal", "made/store/logstore.db-shm", "made/store/indexes.db"} <= set(found)
        assert_private(found, root)


def test_a_folder_the_user_made_keeps_its_mode(tmp_path: Path, umask_022: None) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    with logstore.open(f"sqlite:///{mine}", shards=2):
        pass
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755
    assert stat.S_IMODE((mine / "logstore.db").stat().st_mode) == 0o600


def test_a_standalone_tailers_offsets_and_topic_files_are_private(tmp_path: Path, umask_022: None) -> None:
    root = tmp_path / "tail"
    coordinator = LocalCoordinator(root / "state" / "offsets.json", 2)
    coordinator.start(lambda: None)
    try:
        claim = coordinator.claim(0, lambda: 0)
        assert claim is not None
        coordinator.commit({0: (claim, Offset(5))})
    finally:
        coordinator.stop()

    async def publish() -> None:
        async with DirectoryPublisher(root / "topics" / "out") as publisher:
            await publisher.prepare_topic("cells.BASE", 2, 1)
            await (await publisher.send("cells.BASE", 1, b"k", b"{}", []))

    asyncio.run(publish())
    found = modes(root)
    assert {"tail/state/offsets.json", "tail/state/offsets.json.lock", "tail/topics/out/cells.BASE/partitions",
            "tail/topics/out/cells.BASE/partition-1.jsonl"} <= set(found)
    assert_private(found, root)


def test_the_offsets_file_is_private_even_after_a_crash_left_its_temporary(tmp_path: Path, umask_022: None) -> None:
    (tmp_path / "offsets.json.tmp").write_text("half")  # 0644, as a process killed mid-write left it
    coordinator = LocalCoordinator(tmp_path / "offsets.json", 1)
    coordinator.start(lambda: None)
    try:
        claim = coordinator.claim(0, lambda: 0)
        assert claim is not None
        coordinator.commit({0: (claim, Offset(1))})
    finally:
        coordinator.stop()
    assert stat.S_IMODE((tmp_path / "offsets.json").stat().st_mode) == 0o600


def test_a_parquet_lakes_files_schemas_and_folders_are_private(tmp_path: Path, umask_022: None) -> None:
    from connectors.compaction import LakeCompaction, compaction_params
    from logstore.jobs import JobRunner, KindRegistry

    config = tmp_path / "sink.yaml"
    config.write_text("name: lake\ncolumns: [BASE]\nsink: {type: parquet, root: lake}\n")
    with logstore.open(f"sqlite:///{tmp_path / 'store'}", shards=1) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(4)])
        root = tmp_path / "lake"
        for part in (cells[:2], cells[2:]):  # two commits, two files
            sink = ParquetSink(ParquetSinkConfig(root=root))
            for cell in part:
                sink.add(cell, Position(cell.shard, cell.added_id))
            sink.flush()
        # A compaction writes the partition's new folder and swaps it in: that folder and its file are private.
        runner = JobRunner(store, KindRegistry([LakeCompaction()]))
        runner.run(runner.submit("compact", compaction_params(config, before=dt.date(2099, 1, 1))).id)
    found = modes(root)
    written = [name for name in found if name.endswith(".parquet")]
    assert len(written) == 1, found  # merged
    assert "lake/BASE/_schema.json" in found and "lake/_commits/.lock" in found
    assert [name for name in found if name.startswith("lake/_commits/0")], found  # the records
    assert_private(found, root)


def test_a_lake_root_the_user_made_keeps_its_mode(tmp_path: Path, umask_022: None) -> None:
    root = tmp_path / "lake"
    root.mkdir(mode=0o750)
    ParquetSink(ParquetSinkConfig(root=root))
    assert stat.S_IMODE(root.stat().st_mode) == 0o750


# -- passwords off the command line ---------------------------------------------------------------------------


def test_a_password_is_put_into_a_url_given_without_one() -> None:
    assert with_password("mysql://app@db:3306/cells?ssl_mode=REQUIRED", "p:w@/d") == (
        "mysql://app:p%3Aw%40%2Fd@db:3306/cells?ssl_mode=REQUIRED")
    assert parse_node_url(with_password("mysql://db/cells", "p:w@")).password == "p:w@"  # type: ignore[attr-defined]
    assert url_password("mysql://app:s%40cret@db/cells") == "s%40cret" and url_password("mysql://app@db/c") is None
    with pytest.raises(InvalidArgumentError, match=r"holds a password already") as held:
        with_password("mysql://app:0ld-pw@db/cells", "new")
    assert "0ld-pw" not in str(held.value)
    with pytest.raises(InvalidArgumentError, match="takes no password"):
        with_password("sqlite:///tmp/x", "pw")


def test_the_cli_fills_the_password_from_a_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    url = "mysql://app@db:3306/cells"
    monkeypatch.delenv("CELLSTREAM_STORE_PASSWORD", raising=False)
    assert store_with_password(url, secret, ["cellstream"]) == "mysql://app:from-file@db:3306/cells"
    monkeypatch.setenv("CELLSTREAM_STORE_PASSWORD", "from-env")
    assert store_with_password(url, None, ["cellstream"]) == "mysql://app:from-env@db:3306/cells"
    # The environment's password is for a URL that needs one: another store is left as it is.
    for other in ("sqlite:///x", "mysql://app:own@db/cells", str(tmp_path / "cluster.toml")):
        assert store_with_password(other, None, ["cellstream"]) == other
    for refused in ("sqlite:///x", "mysql://app:own@db/cells", str(tmp_path / "cluster.toml")):
        with pytest.raises(UsageError, match="--store-password-file"):
            store_with_password(refused, secret, ["cellstream"])
    assert not caplog.records


def test_a_password_on_the_command_line_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    url = "mysql://app:hunter2@db:3306/cells"
    assert store_with_password(url, None, ["cellstream", "get", "--store", url]) == url  # old scripts still run
    [warning] = caplog.records
    assert warning.levelno == logging.WARNING and "hunter2" not in warning.getMessage()
    assert "--store-password-file" in warning.getMessage() and "CELLSTREAM_STORE" in warning.getMessage()
    caplog.clear()
    store_with_password(url, None, ["cellstream", f"--store={url}"])
    assert len(caplog.records) == 1
    caplog.clear()
    store_with_password(url, None, ["cellstream", "get"])  # from CELLSTREAM_STORE: only its user reads that
    assert not caplog.records


def test_the_cellstream_command_warns_once_on_stderr(tmp_path: Path) -> None:
    url = "mysql://app:hunter2@127.0.0.1:1/cells"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELLSTREAM_")}
    # --limit 0 is refused once the store is read, before a connection is tried.
    done = subprocess.run([sys.executable, "-m", "cellstream", "log", "0", "--limit", "0", "--store", url],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2 and "--limit must be at least 1" in done.stderr
    assert done.stderr.count("every user of this machine can read") == 1, done.stderr
    assert "hunter2" not in done.stderr


def test_a_mysql_store_opens_with_its_password_kept_off_the_command_line(
        mysql_database: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    user, _, rest = mysql_database.partition("://")[2].partition("@")
    name, password = user.split(":")
    bare = f"mysql://{name}@{rest}"
    (tmp_path / "pw").write_text(password + "\n")
    assert main(["init", "--shards", "4", "--store", bare, "--store-password-file", str(tmp_path / "pw")]) == 0
    assert main(["shards", "--json", "--store", bare]) != 0  # without it: refused by the server
    assert "Access denied" in capsys.readouterr().err
    (tmp_path / "cluster.toml").write_text(f'shards = 4\n[[nodes]]\nname = "a"\nurl = "{bare}"\nshards = "0-3"\n'
                                           'password_file = "pw"\n')
    with logstore.open(tmp_path / "cluster.toml", create=False) as store:
        assert store.shard_count == 4


def write_cluster(folder: Path, node_extra: str) -> Path:
    path = folder / "cluster.toml"
    path.write_text(f'shards = 4\n[[nodes]]\nname = "a"\nurl = "mysql://app@db-a:3306/cells"\nshards = "0-3"\n'
                    f'replicas = ["mysql://app@db-a2:3306/cells", "mysql://ro:theirs@db-a3:3306/cells"]\n{node_extra}')
    return path


def test_a_cluster_files_node_reads_its_password_from_a_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.password").write_text("s3cret:@\n")
    node = load_cluster_file(write_cluster(tmp_path, 'password_file = "a.password"\n')).nodes[0]
    assert node.target.password == "s3cret:@"  # type: ignore[attr-defined]
    assert [t.password for t in node.replica_targets] == ["s3cret:@", "theirs"]  # type: ignore[attr-defined]
    assert "s3cret" not in repr(node) and "s3cret" not in node.model_dump_json()
    monkeypatch.setenv("DB_A_PASSWORD", "from-env")
    node = load_cluster_file(write_cluster(tmp_path, 'password_env = "DB_A_PASSWORD"\n')).nodes[0]
    assert node.target.password == "from-env"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("extra", "problem"), [
    ('password_file = "missing"\n', "cannot be read"),
    ('password_env = "CELLSTREAM_TEST_UNSET_49"\n', "empty or unset"),
    ('password_file = "a.password"\npassword_env = "X"\n', "give one of them"),
])
def test_a_cluster_files_password_that_cannot_be_had_is_refused(tmp_path: Path, extra: str, problem: str) -> None:
    (tmp_path / "a.password").write_text("pw")
    with pytest.raises(ConfigFileError, match=problem):
        load_cluster_file(write_cluster(tmp_path, extra))


def test_a_cluster_files_password_in_two_places_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.password").write_text("pw")
    path = tmp_path / "cluster.toml"
    path.write_text('[[nodes]]\nname = "a"\nurl = "mysql://app:inline@db-a:3306/cells"\nshards = "0-4095"\n'
                    'password_file = "a.password"\n')
    with pytest.raises(ConfigFileError, match="in one place") as refused:
        load_cluster_file(path)
    assert "inline" not in str(refused.value)


# -- log records data cannot forge ----------------------------------------------------------------------------

FORGED = "\n2026-11-26 12:00:00 INFO forged"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def failing_record() -> logging.LogRecord:
    """An error record whose message and exception both quote cell data holding a forged record."""
    try:
        try:
            raise KeyError(f"cell{FORGED}")
        except KeyError as exc:
            raise ValueError(f"body {{'note': 'x{FORGED}\r\x1b[2K'}}") from exc
    except ValueError:
        return logging.LogRecord("tailer", logging.ERROR, __file__, 1, "cannot publish %s", (f"row{FORGED}",),
                                 sys.exc_info())


def test_a_text_record_cannot_be_forged_by_a_newline_in_its_data() -> None:
    text = logsetup.TextFormatter(logsetup.TEXT).format(failing_record())
    lines = text.split("\n")
    assert [line for line in lines if RECORD.match(line)] == [lines[0]], text
    assert lines[0].endswith(r"cannot publish row\n2026-11-26 12:00:00 INFO forged")
    # The traceback keeps its structure, indented; no control character but newline and tab is written raw.
    assert "  Traceback (most recent call last):" in lines and "  The above exception was the direct cause of " \
        "the following exception:" in lines
    assert all(line.startswith(logsetup.CONTINUATION) for line in lines[1:])
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", text)
    assert r"\r\x1b[2K" in text


def test_the_command_logs_text_records_through_that_formatter(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    monkeypatch.setattr(root, "handlers", [])
    try:
        logsetup.configure("text", False)
        assert isinstance(root.handlers[0].formatter, logsetup.TextFormatter)
    finally:
        root.handlers, root.level = saved[0], saved[1]


def test_a_json_record_is_one_line_whatever_its_data() -> None:
    record = failing_record()
    record.msg += " \x85\u2028\x9b"
    text = logsetup.JsonFormatter().format(record)
    assert text.splitlines() == [text]  # str.splitlines breaks at \x85 and \u2028 too
    doc = json.loads(text)
    assert doc["message"].endswith(f"row{FORGED} \x85\u2028\x9b") and FORGED in doc["exception"]
