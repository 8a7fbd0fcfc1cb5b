"""The backends' table (logstore.registry.BACKENDS) is the one place a store URL is resolved, and each layer
has one read of many shards' logs (NodeRecorder.read_logs, Store.read_pages) that every other form goes through."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
import logstore.extras
from logstore.backends.sqlite.target import SQLiteTarget
from logstore.persistence import NodeRecorder
from logstore.registry import BACKENDS, parse_node_url
from tests.harness.stores import two_nodes


def parse_memo(url: str) -> SQLiteTarget:
    """The parser of the test's "memo" backend: SQLite under another scheme."""
    return SQLiteTarget(directory=Path(url.removeprefix("memo:///")))


@pytest.fixture
def memo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A backend added by its table entry alone."""
    monkeypatch.setitem(BACKENDS, "memo", dataclasses.replace(
        BACKENDS["sqlite"], what="a memo store", prefix="memo:///", parser=f"{__name__}:parse_memo"))
    yield


def test_a_backend_added_to_the_table_opens_by_url_and_in_a_cluster_file(memo: None, tmp_path: Path) -> None:
    with logstore.open(f"memo:///{tmp_path}/one", shards=4) as store:
        cell = store.put_cell(uuid.uuid4(), "BASE", 1, {"v": 1})
        assert store.get_cell(cell.row_key, "BASE", 1) == cell
    assert parse_node_url(f"memo:///{tmp_path}/one").redacted() == f"sqlite:///{tmp_path}/one"
    cluster = two_nodes(tmp_path / "cluster.toml", [f"memo:///{tmp_path}/a", f"sqlite:///{tmp_path}/b"], 4)
    with logstore.open(cluster) as store:
        assert store.nodes == ["a", "b"] and store.shard_count == 4
    with pytest.raises(logstore.InvalidArgumentError, match="use sqlite:///, mysql://, http://, https:// or memo:///"):
        logstore.open("redis://localhost")


@pytest.mark.parametrize("url", ["redis://localhost", "redis:///x", "postgres://u@h/db"])
def test_an_unknown_scheme_names_every_known_one(url: str, tmp_path: Path) -> None:
    scheme = url.partition(":")[0]
    known = [backend.prefix for backend in BACKENDS.values()]
    with pytest.raises(logstore.InvalidArgumentError) as info:
        logstore.open(url)
    assert f"unsupported store URL scheme {scheme!r}" in str(info.value)
    assert all(prefix in str(info.value) for prefix in known)
    cluster = two_nodes(tmp_path / "cluster.toml", [url, f"sqlite:///{tmp_path}/b"], 4)
    with pytest.raises(logstore.ConfigurationError) as in_file:
        logstore.open(cluster)
    assert f"unsupported store URL scheme {scheme!r}" in str(in_file.value)
    assert all(prefix in str(in_file.value) for prefix in known)


def test_a_missing_extra_is_named_before_its_driver_is_imported(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    installed = logstore.extras._installed
    monkeypatch.setattr(logstore.extras, "_installed", lambda module: module != "pymysql" and installed(module))
    message = ("a MySQL/MariaDB store needs cellstream[mysql] (pymysql is not installed): "
               "pip install 'cellstream[mysql]'")
    with pytest.raises(logstore.MissingExtraError) as info:
        logstore.open("mysql://u:pw@127.0.0.1:1/cells")
    assert str(info.value) == message
    cluster = two_nodes(tmp_path / "cluster.toml", ["mysql://u:pw@127.0.0.1:1/cells", f"sqlite:///{tmp_path}/b"], 4)
    with pytest.raises(logstore.MissingExtraError) as in_file:
        logstore.open(cluster)
    assert str(in_file.value) == message


def test_what_a_backend_takes_is_its_table_entry(tmp_path: Path) -> None:
    with pytest.raises(logstore.InvalidArgumentError, match="a token is for a worker node's http:// or https:// URL"):
        logstore.open(f"sqlite:///{tmp_path}/s", token="secret")
    cluster = two_nodes(tmp_path / "cluster.toml", ["http://127.0.0.1:1", f"sqlite:///{tmp_path}/b"], 4)
    with pytest.raises(logstore.ConfigurationError, match="a storage node is sqlite:/// or mysql://; a worker node's"):
        logstore.open(cluster)
    cluster.write_text(f'shards = 2\n[[nodes]]\nname = "a"\nurl = "sqlite:///{tmp_path}/a"\nshards = "0-1"\n'
                       f'replicas = ["mysql://u@h/db"]\n')
    with pytest.raises(logstore.ConfigurationError, match="only a mysql:// storage node has replicas"):
        logstore.open(cluster)


def test_parsing_urls_imports_no_driver_and_import_logstore_no_model() -> None:
    code = ("import sys, logstore; assert 'pydantic' not in sys.modules; "
            "from logstore.config import parse_node_url; "
            "parse_node_url('mysql://u:pw@h/db'); parse_node_url('https://h:1'); parse_node_url('sqlite:///d'); "
            "from logstore.backends.http import HttpRecorder; "
            "drivers = ('pymysql', 'logstore.backends.mysql.recorder', 'logstore.backends.sqlite.recorder'); "
            "print(sorted(m for m in drivers if m in sys.modules), HttpRecorder.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "HttpRecorder"]


def test_every_read_of_the_logs_is_one_recorder_call_through_read_pages(sqlite_url: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = logstore.open(sqlite_url, shards=4)
    cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(20)])
    [recorder] = [store.node_recorder(name) for name in store.nodes]
    assert isinstance(recorder, NodeRecorder)
    recorder_calls: list[tuple[Any, ...]] = []
    store_calls: list[bool] = []

    def counted(method: Callable[..., Any], calls: list[Any], key: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(key(*args, **kwargs))
            return method(*args, **kwargs)
        return call

    monkeypatch.setattr(recorder, "read_logs", counted(
        recorder.read_logs, recorder_calls, lambda locations, limit, columns, packed, budget: (len(locations), packed)))
    monkeypatch.setattr(store, "read_pages", counted(
        store.read_pages, store_calls, lambda *args, packed=False, **kwargs: packed))
    shard = cells[0].shard
    page, _ = store.get_cells_for_shard(shard)
    assert page == [c for c in cells if c.shard == shard]
    everything = dict.fromkeys(range(4), 0)
    assert sum(map(len, store.get_cells_for_shards(everything).values())) == 20  # type: ignore[arg-type]
    assert sum(map(len, store.get_packed_cells_for_shards(everything).values())) == 20  # type: ignore[arg-type]
    assert len(store.read_pages(everything, packed=True).decode()[shard]) == len(page)  # type: ignore[arg-type]
    assert recorder_calls == [(1, False), (4, False), (4, True), (4, True)]
    assert store_calls == [False, True, True]
    store.close()


@pytest.fixture(params=["sqlite", "mysql"])
def backend_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("mysql_database" if request.param == "mysql" else "sqlite_url"))


def test_the_latest_cells_of_many_coordinates_are_those_read_one_by_one(backend_url: str) -> None:
    """Store.get_cells_latest: in the order asked, None where there is no cell, the highest ref_key however the
    versions were written, across more coordinates than a MySQL statement takes (500)."""
    with logstore.open(backend_url, shards=64) as store:
        rows = [uuid.uuid4() for _ in range(400)]
        store.put_cells([(r, "A", v, {"v": v, "i": i}) for i, r in enumerate(rows) for v in (1, 3, 2)]
                        + [(r, "B", 5, {"b": i}) for i, r in enumerate(rows[:10])])
        coordinates = [(r, c) for r in rows for c in ("A", "B")] + [(uuid.uuid4(), "A"), (str(rows[7]), "_A")]
        got = store.get_cells_latest(coordinates)
        assert got == [store.get_cell_latest(r, c) for r, c in coordinates]
        assert [(c.ref_key, c.body) if c else None for c in got[:4]] == [(3, {"v": 3, "i": 0}), (5, {"b": 0}),
                                                                           (3, {"v": 3, "i": 1}), (5, {"b": 1})]
        assert got[-2] is None and got[-1] is None and sum(c is None for c in got) == 390 + 2
        assert store.get_cells_latest([]) == []
        with pytest.raises(logstore.InvalidCellError):
            store.get_cells_latest([(rows[0], "no such column!")])
