"""Audit the pinned versions of lock files against the advisories PyPI publishes (`make audit`).

    python scripts/audit_lock.py [--strict] requirements/test.lock [requirements/demo.lock ...]

PyPI's JSON API carries, for a release, the advisories (OSV data: PYSEC, GHSA, CVE ids) that affect
it: `/pypi/NAME/VERSION/json` for any release, `/pypi/NAME/json` for the newest one. This reads the
per-release answer (what pip-audit reads) and, where that is not served (the PyPI mirror CI reaches
serves only the project answer; pip-audit then skips every package and reports nothing), falls back:
a pin that is the newest release is audited exactly; an older pin only against the advisories of the
newest release, since those fixed in between are not visible. Those pins are listed; `--strict` fails on them.

Exit status: 0 when no pinned version has a known advisory, 1 when one has (or, with --strict, when a
pin could only be audited in part), 2 when PyPI could not be asked (a network failure, not a finding).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

PYPI = "https://pypi.org/pypi"
# A pinned line of a lock: `name==version \` (hashes and comments follow on their own lines).
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
ATTEMPTS = 3
TIMEOUT_S = 60.0


class AuditUnavailableError(Exception):
    """PyPI could not tell about a pin (network, TLS or server error, unknown project): nothing was audited."""


@dataclass(frozen=True)
class Finding:
    """A known advisory that applies to a pinned version."""

    name: str
    version: str
    advisory: str
    aliases: tuple[str, ...]
    fixed_in: tuple[str, ...]
    link: str


@dataclass(frozen=True)
class Verdict:
    """The audit of one pin: its findings, and whether the data covered that exact release."""

    name: str
    version: str
    findings: tuple[Finding, ...]
    exact: bool
    newest: str


def read_pins(paths: Iterable[Path]) -> dict[str, str]:
    """The pins of lock files (pip requirements with `name==version` lines), by canonical name.

    Args:
        paths: the lock files.

    Returns:
        canonical name -> pinned version.

    Raises:
        ValueError: two files pin one package at different versions, or a file pins nothing.
    """
    pins: dict[str, str] = {}
    for path in paths:
        found = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            match = _PIN.match(line)
            if match is None:
                continue
            name, version = canonicalize_name(match.group(1)), match.group(2)
            if pins.get(name, version) != version:
                raise ValueError(f"{path} pins {name}=={version}, another lock {pins[name]}")
            pins[name] = version
            found += 1
        if not found:
            raise ValueError(f"{path} pins no package: not a lock file")
    return pins


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def judge(
    name: str, version: str, release: Mapping[str, Any] | None, project: Mapping[str, Any] | None
) -> Verdict:
    """Which advisories apply to a pinned version, from PyPI's JSON answers.

    Args:
        name: the package's canonical name.
        version: the pinned version.
        release: the answer of `/pypi/NAME/VERSION/json`, or None where it is not served.
        project: the answer of `/pypi/NAME/json` (needed when `release` is None).

    Returns:
        The verdict: exact when the advisories read are those of the pinned release itself.

    Raises:
        ValueError: neither answer was given.
    """
    if release is not None:
        vulns, exact, newest = release.get("vulnerabilities") or [], True, str(release["info"]["version"])
    elif project is not None:
        newest = str(project["info"]["version"])
        vulns, exact = project.get("vulnerabilities") or [], _version(newest) == _version(version)
    else:
        raise ValueError(f"no PyPI answer for {name}")
    pinned = _version(version)
    findings: list[Finding] = []
    seen: set[str] = set()  # PyPI lists one advisory under each of its ids (PYSEC, GHSA): report it once
    for vuln in vulns:
        if vuln.get("withdrawn") or str(vuln["id"]) in seen:
            continue
        fixed = tuple(str(v) for v in vuln.get("fixed_in") or ())
        # The newest release's advisories, read for an older pin: one fixed at or below the pin spares it.
        fixed_versions = [f for f in (_version(v) for v in fixed) if f is not None]
        if not exact and pinned is not None and any(f <= pinned for f in fixed_versions):
            continue
        aliases = tuple(str(a) for a in vuln.get("aliases") or ())
        seen.update((str(vuln["id"]), *aliases))
        findings.append(Finding(name, version, str(vuln["id"]), aliases, fixed, str(vuln.get("link") or "")))
    return Verdict(name, version, tuple(findings), exact, newest)


def _get_json(url: str) -> dict[str, Any] | None:
    """GET a JSON answer; None on 404; retried on other failures, then AuditUnavailableError."""
    error: Exception | None = None
    for attempt in range(ATTEMPTS):
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                body: dict[str, Any] = json.load(response)
                return body
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            error = exc
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
            error = exc
        time.sleep(2**attempt)
    raise AuditUnavailableError(
        f"could not ask PyPI's JSON API ({url}: {error}). This is a network failure, not an advisory:"
        " the audit needs https://pypi.org; run `make audit` again"
    )


def fetch(name: str, version: str) -> Verdict:
    """Ask PyPI about one pin (the release's answer, else the project's).

    Raises:
        AuditUnavailableError: PyPI did not answer, or knows neither the release nor the project.
    """
    release = _get_json(f"{PYPI}/{name}/{version}/json")
    project = None if release is not None else _get_json(f"{PYPI}/{name}/json")
    if release is None and project is None:
        raise AuditUnavailableError(f"PyPI knows no project {name!r}: was the lock made from another index?")
    return judge(name, version, release, project)


def audit(pins: Mapping[str, str], workers: int = 8) -> list[Verdict]:
    """Audit every pin, asking PyPI in parallel.

    Raises:
        AuditUnavailableError: PyPI could not be asked about some pin.
    """
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda item: fetch(*item), sorted(pins.items())))


def report(verdicts: Sequence[Verdict], strict: bool) -> int:
    """Print the findings and the partly audited pins; the exit status (see the module's docstring)."""
    findings = [f for v in verdicts for f in v.findings]
    partial = [v for v in verdicts if not v.exact]
    for f in findings:
        ids = ", ".join((f.advisory, *f.aliases))
        fixed = ", ".join(f.fixed_in) or "no fixed release"
        print(f"audit: {f.name}=={f.version}: {ids} (fixed in: {fixed}) {f.link}")
    if partial:
        print(
            f"audit: {len(partial)} pin(s) are older than their newest release and PyPI's per-release answer"
            " is not served here, so they were checked against the newest release's advisories only:"
        )
        for v in partial:
            print(f"audit:   {v.name}=={v.version} (newest {v.newest})")
    exact = len(verdicts) - len(partial)
    print(f"audit: {len(verdicts)} pins, {exact} audited exactly, {len(findings)} known advisories")
    if findings:
        print("audit: FAILED: raise the floor in pyproject.toml past the fix, `make lock`, commit both")
        return 1
    if partial and strict:
        print("audit: FAILED (--strict): `make lock LOCK_FLAGS=--upgrade` moves the pins to the newest releases")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("locks", nargs="+", type=Path, help="lock files (pip requirements with hashes)")
    parser.add_argument("--strict", action="store_true", help="fail when a pin can be audited only in part")
    args = parser.parse_args(argv)
    try:
        pins = read_pins(args.locks)
    except (OSError, ValueError) as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    try:
        verdicts = audit(pins)
    except AuditUnavailableError as exc:
        print(f"audit: nothing audited: {exc}", file=sys.stderr)
        return 2
    return report(verdicts, args.strict)


if __name__ == "__main__":
    sys.exit(main())
