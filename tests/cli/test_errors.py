"""The project's errors: one root, each package's classes in its ``errors`` module, one class per concept, and
one exit code for each in the CLI's table."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import connectors.errors
import indexer.errors
import logstore.errors
import tailer.errors
from cellstream.cli.exits import Exit, exit_code
from logstore.errors import CellstreamError

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
