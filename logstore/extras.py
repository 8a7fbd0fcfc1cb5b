"""Optional dependencies: the base install is the embedded default (SQLite, direct mode, the CLI);
everything else comes with an extra. :func:`require` turns a missing one into a one-line
:class:`~logstore.errors.MissingExtraError` before anything imports it.
"""

from __future__ import annotations

import importlib.util
import sys

from logstore.errors import MissingExtraError

# extra -> the modules it installs (the top-level import names, as find_spec wants them)
EXTRAS: dict[str, tuple[str, ...]] = {
    "mysql": ("pymysql",),
    "kafka": ("aiokafka",),
    "faust": ("aiokafka", "faust"),
    "zookeeper": ("kazoo",),
    "server": ("aiohttp",),
    "console": ("aiohttp", "jinja2"),
    "parquet": ("pyarrow",),
    "postgres": ("psycopg",),
    "iceberg": ("pyiceberg", "sqlalchemy", "pyarrow"),
    "backup": ("boto3",),
    "migrate": ("pymysql", "psycopg", "pymysqlreplication"),
}


def missing(extra: str) -> str | None:
    """The first module of ``extra`` that is not installed, or None when all are."""
    return next((module for module in EXTRAS[extra] if not _installed(module)), None)


def _installed(module: str) -> bool:
    # An imported module may carry no __spec__ (faust replaces its own module object): find_spec would raise.
    return module in sys.modules or importlib.util.find_spec(module) is not None


def require(extra: str, what: str) -> None:
    """Raise MissingExtraError (naming ``what`` needs it) unless every module of ``extra`` is installed."""
    module = missing(extra)
    if module is not None:
        raise MissingExtraError(extra, module, what)
