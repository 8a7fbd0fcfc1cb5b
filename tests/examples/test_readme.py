"""The README's first app and its test, run as a reader would: saved as first_app.py and test_first_app.py
in an empty directory, the app run with python, its test with pytest (the fixture from the installed
package's plugin)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"


def block(starting: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    [found] = [b for b in blocks if starting in b]
    return found


def test_the_readme_first_app_and_its_test_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(first_app=block("def bill_rider(cell, ctx)"),
                        test_first_app=block("# test_first_app.py"))

    run = subprocess.run([sys.executable, "first_app.py"], cwd=pytester.path, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "charge rider-1 12.5" in run.stdout
    assert "Counts(processed=1, retried=0, dead_lettered=1)" in run.stdout

    result = pytester.runpytest_subprocess("test_first_app.py", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
