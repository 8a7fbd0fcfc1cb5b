"""A SQLite storage node's URL: ``sqlite:///relative/dir`` or ``sqlite:////absolute/dir`` (SQLAlchemy's
convention), the directory holding its database files."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from logstore.errors import InvalidArgumentError

_PREFIX = "sqlite:///"


class SQLiteTarget(BaseModel):
    """A SQLite storage node: the directory of its database files."""

    model_config = ConfigDict(frozen=True)

    directory: Path

    def redacted(self) -> str:
        return f"{_PREFIX}{self.directory}"


def parse_url(url: str) -> SQLiteTarget:
    """The target of a ``sqlite:///`` URL; InvalidArgumentError without a directory."""
    path = url[len(_PREFIX):] if url.startswith(_PREFIX) else ""
    if not path:
        raise InvalidArgumentError("sqlite URL needs a directory: sqlite:///path/to/dir")
    return SQLiteTarget(directory=Path(path))
