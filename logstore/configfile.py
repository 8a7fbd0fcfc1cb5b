"""Configuration files: YAML (``yaml.safe_load``, so no tag builds an object) validated by a pydantic model.

Every problem is a :class:`~logstore.errors.ConfigFileError` that names the file, the line and the dotted
field, list items named by their ``name`` (``indexes[trips].fields[fare].type``). The index definitions
(:mod:`indexer.indexes.definitions`) and the connectors' files (:mod:`connectors.config`) are read here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from logstore.errors import ConfigFileError

M = TypeVar("M", bound=BaseModel)


def read_text(path: Path, name: str) -> str:
    """A configuration file's text; ConfigFileError under ``name`` when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigFileError(name, None, "", f"cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigFileError(name, None, "", "cannot read it: it is not UTF-8 text") from None


def load_yaml(source: str | Path, model: type[M], label: str, shape: str) -> M:
    """A pydantic model from a YAML file or YAML text.

    Args:
        source: the file (a Path), or the text itself (a str).
        model: the model the file's mapping must validate as.
        label: what errors call text given as a str (``<indexes>``).
        shape: what the file must be, for the error when it is not a mapping ("a mapping with an 'indexes' list").

    Returns:
        The validated model.

    Raises:
        ConfigFileError: the file cannot be read, is not valid YAML, is not a mapping, or does not validate
            (the first problem, with its line and dotted field).
    """
    if isinstance(source, Path):
        name, text = str(source), read_text(source, str(source))
    else:
        name, text = label, source
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context
        raise ConfigFileError(name, mark.line + 1 if mark else None, "", f"not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(name, None, "", f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(name, 1, "", f"the file must be {shape}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        line, field, message = _locate(root, tuple(error["loc"]), error["msg"].removeprefix("Value error, "))
        raise ConfigFileError(name, line, field, message) from None


def _locate(root: yaml.Node | None, loc: tuple[Any, ...], message: str) -> tuple[int | None, str, str]:
    """The line and the dotted field of a validation error, list items named by their ``name``."""
    node, path, parts = root, list[str](), list(loc)
    while parts and _tag(node) == parts[0]:  # a tagged union's member, named by the mapping's own type
        parts.pop(0)
    while parts and (child := _child(node, parts[0])) is not None:
        part, node = parts.pop(0), child
        named = _child(child, "name") if isinstance(part, int) else None
        if isinstance(part, int) and path:
            path[-1] += f"[{named.value if isinstance(named, yaml.ScalarNode) else part}]"
        else:
            path.append(str(part))
        while parts and _tag(node) == parts[0]:
            parts.pop(0)
    line = node.start_mark.line + 1 if node is not None else None
    # A check across fields says which one it is about first ("shard_field: ..."): point at that key.
    head, sep, rest = message.partition(": ")
    key = _key(node, head) if sep and not parts else None
    if key is not None:
        line, message = key.start_mark.line + 1, rest
        path.append(head)
    path.extend(str(p) for p in parts)  # a missing field: named, on the line of what should hold it
    return line, ".".join(path), message


def _tag(node: yaml.Node | None) -> str | None:
    """The ``type`` of a mapping node (what a tagged union's error location names it by)."""
    found = _entry(node, "type")
    return str(found[1].value) if found is not None and isinstance(found[1], yaml.ScalarNode) else None


def _entry(node: yaml.Node | None, name: Any) -> tuple[yaml.Node, yaml.Node] | None:
    """The (key, value) nodes of ``name`` in a mapping node."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == name:
                return key, value
    return None


def _key(node: yaml.Node | None, name: str) -> yaml.Node | None:
    found = _entry(node, name)
    return found[0] if found else None


def _child(node: yaml.Node | None, part: Any) -> yaml.Node | None:
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        child: yaml.Node = node.value[part]
        return child
    found = _entry(node, part)
    return found[1] if found else None
