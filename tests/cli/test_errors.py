"""The project's errors: one root, each package's classes in its ``errors`` module, one class per concept, and
one exit code for each in the CLI's table."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import connectors.errors
import indexer.errors
import logstore.errors
import tailer.errors
from cellstream.cli.exits import Exit, exit_code
from connectors.config import load_connector
from indexer.indexes.definitions import load_indexes
from logstore.errors import CellstreamError, ConfigFileError

PACKAGES = ("logstore", "tailer", "indexer", "connectors", "cellstream")


def defined_errors() -> dict[str, list[type[BaseException]]]:
    """Every public exception class defined in the packages, by the module that defines it. A private one is a
    module's internal signal, caught where it is raised; the demo's example apps are user code."""
    found: dict[str, list[type[BaseException]]] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if info.name.endswith(".__main__") or info.name.startswith("cellstream.demo.examples"):  # runs main()
                continue
            module = importlib.import_module(info.name)
            for _, value in inspect.getmembers(module, inspect.isclass):
                if issubclass(value, BaseException) and value.__module__ == info.name \
                        and not value.__name__.startswith("_"):
                    found.setdefault(info.name, []).append(value)
    return found


def test_every_error_class_is_in_its_packages_errors_module_under_the_one_root() -> None:
    found = defined_errors()
    outside = {module: [c.__name__ for c in classes] for module, classes in found.items()
               if module.rsplit(".", 1)[-1] != "errors" and module != "logstore.backends.mysql.errors"}
    assert outside == {}
    assert all(issubclass(c, CellstreamError) for classes in found.values() for c in classes)


def test_one_class_per_concept() -> None:
    by_name: dict[str, set[type[BaseException]]] = {}
    for classes in defined_errors().values():
        for c in classes:
            by_name.setdefault(c.__name__, set()).add(c)
    assert {name: len(classes) for name, classes in by_name.items() if len(classes) > 1} == {}
    assert tailer.errors.ConfigurationError is indexer.errors.ConfigurationError is \
        connectors.errors.ConfigurationError is logstore.errors.ConfigurationError


@pytest.mark.parametrize("module", [logstore.errors, tailer.errors, indexer.errors, connectors.errors])
def test_a_configuration_error_from_any_package_exits_4(module: object) -> None:
    assert exit_code(module.ConfigurationError("a bad option")) == Exit.CONFIG == 4  # type: ignore[attr-defined]


def test_a_bad_index_or_connector_file_is_the_one_config_file_error_and_exits_4(tmp_path: Path) -> None:
    indexes = tmp_path / "indexes.yaml"
    indexes.write_text("indexes:\n  - name: trips\n    column: BASE\n    version: 0\n    shard_field: rider\n"
                       "    fields: [{name: rider, type: uuid, key: true}]\n")
    connector = tmp_path / "lake.yaml"
    connector.write_text("name: lake\ncolumns: [BASE]\nsink: {type: parquet, root: lake, max_rows: 0}\n")
    errors = []
    for load, path in ((load_indexes, indexes), (load_connector, connector)):
        with pytest.raises(ConfigFileError) as error:
            load(path)
        errors.append(error.value)
    assert [(e.source, e.line, e.field) for e in errors] == [
        (str(indexes), 4, "indexes[trips].version"), (str(connector), 3, "sink.max_rows")]
    assert all(exit_code(e) == Exit.CONFIG for e in errors)
