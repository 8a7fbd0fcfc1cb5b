"""The dependency floors and the locks.

pyproject.toml's floors may not drop below the reviewed ones (``REVIEWED_FLOORS``: the first release fixing
every advisory known for the package, or the floor found free of advisories), and every dependency it
names must have been reviewed. The locks (``make lock``) are what CI and the demo install: every locked
version satisfies pyproject's specifiers, every dependency is locked, hashed, and the demo's lock agrees
with the test lock. ``scripts/audit_lock.py`` (``make audit``) reads PyPI's advisories for the locked
versions; its verdicts are tested here on PyPI-shaped answers, without the network.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
TEST_LOCK = ROOT / "requirements" / "test.lock"
DEMO_LOCK = ROOT / "requirements" / "demo.lock"
DEMO_EXTRAS = ("parquet", "server")  # what the Makefile's .venv/.base installs from the demo lock
# The locks' target (Makefile: `make lock`): markers are evaluated for it.
TARGET: dict[str, str] = {key: str(value) for key, value in default_environment().items()}
TARGET.update(python_version="3.11", sys_platform="linux", platform_system="Linux")

# name -> (the lowest floor pyproject may set, or None for stubs never run; why). Raise an entry when an
# advisory is fixed in a later release; lower one only with a new review.
REVIEWED_FLOORS: dict[str, tuple[str | None, str]] = {
    "msgpack": ("1.2.1", "CVE-2026-57585 / GHSA-6v7p-g79w-8964: Unpacker reuse after an error reads out of bounds"),
    "orjson": ("3.11.6", "CVE-2024-27454 / GHSA-pwr2-4v36-6qpr (3.9.15), CVE-2025-67221 / GHSA-hx9q-6w63-j58v: "
               "unbounded recursion on deeply nested JSON"),
    "pydantic": ("2.6", "CVE-2024-3772 / GHSA-mr82-8j83-vxmv fixed in 2.4.0"),
    "prometheus-client": ("0.19", "no advisory found"),
    "pyyaml": ("6", "CVE-2020-14343 / PYSEC-2021-142 fixed in 5.4"),
    "tqdm": ("4.66.3", "CVE-2024-34062 / GHSA-g7vv-2v7x-gj9p: eval of CLI arguments"),
    "pymysql": ("1.1.1", "CVE-2024-36039 / GHSA-v9hf-5j83-6xpp: SQL injection through escape_dict keys"),
    "aiokafka": ("0.11", "no advisory found"),
    "confluent-kafka": ("2.12", "no advisory found; its wheels bundle librdkafka 2.12+, which the Kafka-mode "
                        "consumer is written against"),
    "faust-streaming": ("0.11", "no advisory found"),
    "kazoo": ("2.9", "no advisory found"),
    "aiohttp": ("3.14.3", "server-side advisories reachable before login: CVE-2024-27306, CVE-2024-30251 (3.9.4), "
                "CVE-2024-52304 (3.10.11), CVE-2025-53643 (3.12.14), CVE-2025-69223..69230 (3.13.3), "
                "CVE-2026-22815 and CVE-2026-34513..34525 (3.13.4), CVE-2026-34993 and CVE-2026-47265 (3.14.0), "
                "CVE-2026-54273..54280 (3.14.1), CVE-2026-69243 (3.14.2), CVE-2026-69244 (3.14.3)"),
    "uvloop": ("0.19", "no advisory found at or above this floor"),
    "jinja2": ("3.1.6", "CVE-2024-22195, CVE-2024-34064, CVE-2024-56201, CVE-2024-56326, "
               "CVE-2025-27516 / GHSA-cpwx-vrp4-4pq7"),
    "pyarrow": ("23.0.1", "CVE-2023-47248 (14.0.1), CVE-2024-52338 / PYSEC-2024-161 (17.0.0), "
                "CVE-2026-25087 / GHSA-rgxp-2hwp-jwgg (23.0.1)"),
    "psycopg": ("3.1", "no advisory found"),
    "mysql-replication": ("1.0.17", "no advisory found; 1.0.17 is the release the MySQL migration source is "
                          "written against (its TIMESTAMP and string decoding)"),
    "pyiceberg": ("0.12", "no advisory found; 0.12 is the release the Iceberg sink is written against"),
    "sqlalchemy": ("2.0.18", "CVE-2019-7164 / CVE-2019-7548 fixed in 1.3.0; pyiceberg's SQL catalog needs 2.0.18"),
    "mkdocs-material": ("9.7.7", "CVE-2026-73295 / GHSA-xvg9-69gf-fjrf: DOM XSS in search suggestions"),
    "pytest": ("9.0.3", "CVE-2025-71176 / GHSA-6w46-j5rx-g56g: predictable /tmp/pytest-of-USER"),
    "pytest-timeout": ("2.2", "no advisory found"),
    "ruff": ("0.5", "no advisory found"),
    "mypy": ("1.10", "no advisory found"),
    "import-linter": ("2.17", "no advisory found; the acyclic_siblings contract needs it"),
    "grimp": ("3.0", "no advisory found"),
    "types-pymysql": (None, "typing stubs, never run"),
    "types-pyyaml": (None, "typing stubs, never run"),
    "types-tqdm": (None, "typing stubs, never run"),
    "boto3": ("1.34", "no advisory found (boto3, botocore, s3transfer)"),
    "boto3-stubs": (None, "typing stubs, never run"),
    "psutil": ("5.9", "CVE-2019-18874 / PYSEC-2019-41 fixed in 5.6.6"),
    "duckdb": ("1.4.2", "CVE-2024-41672 / GHSA-w2gf-jxc9-pf2q (1.1.0), CVE-2025-64429 / GHSA-vmp8-hg63-v2hp "
               "(1.4.0 and 1.4.1)"),
    "schemathesis": ("4.30", "no advisory found"),
    "trustme": ("1.1", "no advisory found"),
    "selenium": ("4.20", "CVE-2023-5590 / PYSEC-2023-206 fixed in 4.14.0"),
}


def load_audit() -> ModuleType:
    """scripts/audit_lock.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("audit_lock", ROOT / "scripts" / "audit_lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


audit_lock = load_audit()


def requirements(pyproject: dict[str, Any], extras: tuple[str, ...] | None = None) -> Iterator[Requirement]:
    """pyproject's requirements (the base ones and those of `extras`, all extras when None), its own extras left out."""
    project = pyproject["project"]
    optional: dict[str, list[str]] = project["optional-dependencies"]
    lists = [project["dependencies"], *(optional[e] for e in (optional if extras is None else extras))]
    for entries in lists:
        for entry in entries:
            requirement = Requirement(entry)
            if canonicalize_name(requirement.name) != canonicalize_name(project["name"]):
                yield requirement


def lowest_allowed(specifier: SpecifierSet) -> Version | None:
    """The floor a specifier sets (its highest lower bound), None when it sets none."""
    bounds = [Version(s.version) for s in specifier if s.operator in (">=", ">", "==", "~=", "===")]
    return max(bounds, default=None)


def floor_violations(pyproject: dict[str, Any]) -> list[str]:
    """The dependencies of pyproject that were not reviewed, or whose floor is below the reviewed one."""
    problems = []
    for requirement in requirements(pyproject):
        name = canonicalize_name(requirement.name)
        if name not in REVIEWED_FLOORS:
            problems.append(f"{name}: not reviewed (add it to REVIEWED_FLOORS with its advisories)")
            continue
        reviewed = REVIEWED_FLOORS[name][0]
        if reviewed is None:
            continue
        floor = lowest_allowed(requirement.specifier)
        if floor is None or floor < Version(reviewed):
            problems.append(f"{name}: pyproject allows {requirement.specifier or 'any'}, reviewed floor {reviewed}")
    return problems


def lock_violations(pyproject: dict[str, Any], pins: dict[str, str], extras: tuple[str, ...] | None) -> list[str]:
    """The requirements of pyproject that a lock misses or pins outside their specifier."""
    problems = []
    for requirement in requirements(pyproject, extras):
        if requirement.marker is not None and not requirement.marker.evaluate(TARGET):
            continue
        name = canonicalize_name(requirement.name)
        if name not in pins:
            problems.append(f"{name}: not locked")
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{name}=={pins[name]} is locked, pyproject wants {requirement.specifier}")
    return problems


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


def test_every_dependency_was_reviewed_and_no_floor_is_below_its_review(pyproject: dict[str, Any]) -> None:
    assert floor_violations(pyproject) == []
    named = {canonicalize_name(r.name) for r in requirements(pyproject)}
    assert set(REVIEWED_FLOORS) - named == set(), "REVIEWED_FLOORS names a package pyproject no longer depends on"


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("aiohttp>=3.9,<4", "aiohttp: pyproject allows <4,>=3.9, reviewed floor 3.14.3"),
        ("aiohttp<4", "aiohttp: pyproject allows <4, reviewed floor 3.14.3"),
        ("jinja2", "jinja2: pyproject allows any, reviewed floor 3.1.6"),
        ("leftpad>=1", "leftpad: not reviewed (add it to REVIEWED_FLOORS with its advisories)"),
    ],
)
def test_a_lowered_missing_or_unreviewed_floor_is_refused(
    pyproject: dict[str, Any], entry: str, problem: str
) -> None:
    project = {**pyproject["project"], "dependencies": [*pyproject["project"]["dependencies"], entry]}
    assert floor_violations({**pyproject, "project": project}) == [problem]


def test_the_test_lock_pins_every_dependency_within_pyproject(pyproject: dict[str, Any]) -> None:
    pins = audit_lock.read_pins([TEST_LOCK])
    assert lock_violations(pyproject, pins, None) == []
    # The test extra names every other extra (through "all" and "docs"): the lock is the whole closure.
    assert lock_violations(pyproject, {**pins, "aiohttp": "3.14.2"}, None) == [
        "aiohttp==3.14.2 is locked, pyproject wants <4,>=3.14.3"
    ]


def test_the_demo_lock_pins_the_demo_extras_at_the_test_lock_versions(pyproject: dict[str, Any]) -> None:
    demo, test = audit_lock.read_pins([DEMO_LOCK]), audit_lock.read_pins([TEST_LOCK])
    assert lock_violations(pyproject, demo, DEMO_EXTRAS) == []
    assert {name: version for name, version in demo.items() if test.get(name) != version} == {}
    assert audit_lock.read_pins([TEST_LOCK, DEMO_LOCK]) == test


@pytest.mark.parametrize("lock", [TEST_LOCK, DEMO_LOCK], ids=lambda p: p.name)
def test_every_pin_carries_its_hashes(lock: Path) -> None:
    unhashed, pin = [], None
    for line in lock.read_text(encoding="utf-8").splitlines():
        if audit_lock._PIN.match(line):
            if pin is not None:
                unhashed.append(pin)
            pin = line.split()[0]
        elif pin is not None and line.strip().startswith("--hash=sha256:"):
            pin = None
    assert unhashed + ([pin] if pin else []) == []


def test_two_locks_disagreeing_on_a_version_are_refused(tmp_path: Path) -> None:
    one, other = tmp_path / "one.lock", tmp_path / "other.lock"
    one.write_text("aiohttp==3.14.5 \\\n    --hash=sha256:00\n")
    other.write_text("AIOHTTP==3.14.3\n")
    with pytest.raises(ValueError, match="aiohttp"):
        audit_lock.read_pins([one, other])
    other.write_text("# nothing pinned\n")
    with pytest.raises(ValueError, match="pins no package"):
        audit_lock.read_pins([one, other])


def vuln(
    ident: str, fixed_in: list[str], aliases: list[str] | None = None, withdrawn: str | None = None
) -> dict[str, Any]:
    """One entry of the "vulnerabilities" list of PyPI's JSON API."""
    link = f"https://osv.dev/vulnerability/{ident}"
    return {"id": ident, "aliases": aliases or [], "fixed_in": fixed_in, "link": link, "withdrawn": withdrawn}


def answer(version: str, *vulns: dict[str, Any]) -> dict[str, Any]:
    return {"info": {"version": version}, "vulnerabilities": list(vulns)}


def test_a_release_answer_is_audited_exactly() -> None:
    verdict = audit_lock.judge(
        "aiohttp",
        "3.14.2",
        answer("3.14.2", vuln("GHSA-a", ["3.14.3"], ["CVE-1"]), vuln("CVE-1", ["3.14.3"], ["GHSA-a"]),
               vuln("GHSA-old", ["3.0"], withdrawn="2026-01-01")),
        None,
    )
    assert verdict.exact
    assert [(f.advisory, f.aliases, f.fixed_in) for f in verdict.findings] == [("GHSA-a", ("CVE-1",), ("3.14.3",))]
    assert not audit_lock.judge("aiohttp", "3.14.3", answer("3.14.3"), None).findings


def test_without_a_release_answer_the_newest_release_answer_is_read() -> None:
    project = answer("3.14.5", vuln("GHSA-open", []), vuln("GHSA-fixed", ["3.14.3", "3.15.0"]))
    newest = audit_lock.judge("aiohttp", "3.14.5", None, project)
    assert newest.exact and [f.advisory for f in newest.findings] == ["GHSA-open", "GHSA-fixed"]
    # An older pin: only partly audited; an advisory fixed at or below it spares it.
    older = audit_lock.judge("aiohttp", "3.14.4", None, project)
    assert not older.exact and [f.advisory for f in older.findings] == ["GHSA-open"]
    assert [f.advisory for f in audit_lock.judge("aiohttp", "3.14.2", None, project).findings] == [
        "GHSA-open",
        "GHSA-fixed",
    ]


def test_the_report_fails_on_an_advisory_and_on_a_partial_audit_only_when_strict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean = audit_lock.judge("msgpack", "1.2.4", answer("1.2.4"), None)
    partial = audit_lock.judge("click", "8.3.3", None, answer("8.5.1"))
    found = audit_lock.judge("msgpack", "1.2.0", answer("1.2.0", vuln("GHSA-6v7p-g79w-8964", ["1.2.1"])), None)
    assert audit_lock.report([clean, partial], strict=False) == 0
    assert audit_lock.report([clean, partial], strict=True) == 1
    assert audit_lock.report([clean, found], strict=False) == 1
    out = capsys.readouterr().out
    assert "click==8.3.3 (newest 8.5.1)" in out
    assert "msgpack==1.2.0: GHSA-6v7p-g79w-8964 (fixed in: 1.2.1)" in out
