"""The configuration-file loader: YAML read safely, validated, every problem one ConfigFileError line."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from logstore.configfile import load_yaml
from logstore.errors import ConfigFileError, ConfigurationError


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    size: int = Field(ge=1)


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str
    parts: list[Part]


def load(source: str | Path) -> Plan:
    return load_yaml(source, Plan, "<plan>", "a mapping with a title and parts")


def test_a_file_gives_its_model() -> None:
    plan = load("title: shelf\nparts:\n  - {name: board, size: 3}\n")
    assert plan == Plan(title="shelf", parts=[Part(name="board", size=3)])


@pytest.mark.parametrize(("text", "message"), [
    ("title: shelf\nparts:\n  - {name: board, size: 3}\n  - {name: leg, size: 0}\n",
     "<plan>:4: parts[leg].size: Input should be greater than or equal to 1"),
    ("title: shelf\nparts:\n  - {name: board, size: 3, colour: red}\n",
     "<plan>:3: parts[board].colour: Extra inputs are not permitted"),
    ("title: shelf\n", "<plan>:1: parts: Field required"),
    ("title: [shelf\n", "<plan>:2: not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ("- a list\n", "<plan>:1: the file must be a mapping with a title and parts"),
])
def test_a_problem_is_one_configuration_error_naming_the_line_and_field(text: str, message: str) -> None:
    with pytest.raises(ConfigFileError) as error:
        load(text)
    assert str(error.value) == message
    assert isinstance(error.value, ConfigurationError) and not error.value.retriable


def test_a_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match=r"missing\.yaml: cannot read it: No such file"):
        load(tmp_path / "missing.yaml")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("title: étagère\nparts: []\n".encode("latin-1"))
    with pytest.raises(ConfigFileError) as error:
        load(latin)
    assert str(error.value) == f"{latin}: cannot read it: it is not UTF-8 text"


def test_yaml_tags_build_no_objects() -> None:
    with pytest.raises(ConfigFileError, match="not valid YAML: could not determine a constructor"):
        load("title: !!python/object/apply:os.getcwd []\nparts: []\n")


def test_the_message_is_one_line_whatever_the_problem_says() -> None:
    error = ConfigFileError("plan.yaml", 7, "parts[leg]", "first\n  second")
    assert str(error) == "plan.yaml:7: parts[leg]: first second" and error.problem == "first second"
    assert str(ConfigFileError("plan.yaml", None, "", "cannot read it")) == "plan.yaml: cannot read it"
