"""``cellstream dlq policy show|set|reset``: the redrive policy in force, changed from the command line (recorded
with the user), the app's declaration put back; bad input is one line and exit code 2."""

from __future__ import annotations

import getpass
import json
from pathlib import Path

import pytest

import logstore
from cellstream.cli.main import main

APP = '''
from indexer import App

app = App("cli", store={url!r}, redrive={{"delay": 300, "max_redrives": 3, "errors": ["Timeout"]}})

@app.trigger("BASE")
def charge(cell):
    pass
'''


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_show_set_and_reset_the_redrive_policy(sqlite_url: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    module = tmp_path / "policyapp.py"
    module.write_text(APP.format(url=sqlite_url))
    spec = f"{module}:app"
    with logstore.open(sqlite_url, shards=8):
        pass
    code, out, _ = run(capsys, "dlq", "--app", spec, "policy", "show")
    assert code == 0 and "no redrive policy" in out  # not seeded before the app first ran
    assert run(capsys, "run", spec, "--drain")[0] == 0  # seeds the declaration

    code, out, _ = run(capsys, "dlq", "--app", spec, "policy", "show", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["in_force"]["origin"] == "declared"
    assert shown["in_force"]["policy"]["errors"] == ["Timeout"]

    code, out, _ = run(capsys, "dlq", "--app", spec, "policy", "set", "max_redrives=5", "errors=Timeout,Declined",
                       "--note", "the gateway is flaky", "--json")
    changed = json.loads(out)["in_force"]
    assert code == 0 and changed["origin"] == "operator" and changed["actor"] == f"cli:{getpass.getuser()}"
    assert changed["policy"]["max_redrives"] == 5 and changed["policy"]["delay"] == 300  # the rest as in force
    assert changed["policy"]["errors"] == ["Timeout", "Declined"] and changed["note"] == "the gateway is flaky"

    code, out, err = run(capsys, "dlq", "--app", spec, "policy", "set", "max_redrives=0")
    assert code == 2 and err.count("\n") == 1 and "max_redrives" in err
    code, out, err = run(capsys, "dlq", "--app", spec, "policy", "set")
    assert code == 2 and "FIELD=VALUE" in err

    code, out, _ = run(capsys, "dlq", "--app", spec, "policy", "reset")
    assert code == 0 and "the app's declaration" in out and "v3" in out and "(operator): the gateway" in out
    code, out, _ = run(capsys, "dlq", "--app", spec, "policy", "show", "--json")
    assert json.loads(out)["in_force"]["policy"]["max_redrives"] == 3
    code, out, _ = run(capsys, "dlq", "--app", spec, "policy", "show")
    assert '"max_redrives":3' in out  # every field shown, those equal to their defaults too
