"""The console's server over HTTP, as any client sees it: the login, the session, CSRF, the origin check,
the confirmations of bulk actions, the filters and paging, /metrics, and what is (not) rendered."""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from pydantic import SecretStr, ValidationError

import logstore
from cellstream.cli.main import main
from cellstream.console import Console, ConsoleConfig
from tests.console.support import TriageApp, serving, triage_app, write_trips
from tests.harness.tls import make_pki

TOKEN = "console-token-9d2e-0123456789"


@pytest.fixture
def billing(tmp_path: Path) -> TriageApp:
    return triage_app(tmp_path)


@pytest.fixture
def console(billing: TriageApp) -> Iterator[Console]:
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN), page_size=5) as running:
        yield running


def logged_in(console: Console, name: str = "bob") -> tuple[requests.Session, str]:
    """A client with a session; and the session's CSRF token (from a page's form)."""
    client = requests.Session()
    r = client.post(console.url + "/login", data={"name": name, "token": TOKEN, "next": "/"})
    assert r.status_code == 200 and r.url == console.url + "/"
    return client, csrf_of(r.text)


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "no CSRF field in the page"
    return found.group(1)


def finished(client: requests.Session, job_url: str) -> str:
    """The job page once the job is no longer running (the job works in the background)."""
    deadline = time.monotonic() + 60
    while 'id="state">running' in (page := client.get(job_url).text):
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.05)
    return page


def next_field(page: str) -> str:
    """The login form's ``next`` field."""
    found = re.search(r'name="next" value="([^"]+)"', page)
    assert found, "no next field in the login page"
    return html.unescape(found.group(1))


def open_entries(billing: TriageApp, handler: str) -> list[str]:
    return [e.id for e in billing.queue.list(handler=handler) if e.status == "open"]


def test_without_a_session_pages_send_to_the_login_and_actions_are_refused(console: Console,
                                                                             billing: TriageApp) -> None:
    anonymous = requests.Session()
    for path in ("/", "/entries?handler=notify", "/jobs", "/bulk/replay"):
        r = anonymous.get(console.url + path, allow_redirects=False)
        assert r.status_code == 303 and r.headers["Location"].startswith("/login")
    entry = open_entries(billing, "bill_rider")[0]
    r = anonymous.post(f"{console.url}/entries/billing/{entry}/discard", data={"reason": "x", "csrf": "x"},
                       allow_redirects=False)
    assert r.status_code == 403
    r = anonymous.post(console.url + "/login", data={"name": "mallory", "token": "guess", "next": "/"},
                       allow_redirects=False)
    assert r.status_code == 401 and "wrong token" in r.text and not anonymous.cookies
    assert "guess" not in r.text  # a token typed in is never sent back
    r = anonymous.post(console.url + "/login", data={"name": "", "token": TOKEN}, allow_redirects=False)
    assert r.status_code == 401 and "give your name" in r.text
    assert billing.queue.show(entry).status == "open"
    # After the login, back to the page asked for, its whole filter included.
    r = anonymous.get(console.url + "/entries?handler=notify&status=open")
    assert r.url.startswith(console.url + "/login?next=")
    r = anonymous.post(console.url + "/login", data={"name": "bob", "token": TOKEN, "next": next_field(r.text)})
    assert r.url == console.url + "/entries?handler=notify&status=open" and "Entries 1 to 3 of 3" in r.text


def test_every_action_needs_the_csrf_token_of_the_session(console: Console, billing: TriageApp) -> None:
    client, csrf = logged_in(console)
    entry = open_entries(billing, "notify")[0]
    url = f"{console.url}/entries/billing/{entry}/discard"
    for data in ({"reason": "no address"}, {"reason": "no address", "csrf": "forged"}):
        r = client.post(url, data=data, allow_redirects=False)
        assert r.status_code == 403 and "CSRF" in r.text
    _, other_csrf = logged_in(console, "eve")
    assert client.post(url, data={"reason": "no address", "csrf": other_csrf}, allow_redirects=False).status_code == 403
    assert billing.queue.show(entry).status == "open"

    r = client.post(url, data={"reason": "no address", "csrf": csrf})
    assert r.status_code == 200 and re.search(r"/jobs/\d+$", r.url)
    page = finished(client, r.url)
    assert 'id="state">done' in page
    [row] = re.findall(r"<tr><td>.*?</tr>", page, re.S)
    assert re.search(r"<td>open</td>\s*<td><span class=\"status status-discarded\">discarded</span>", row)
    discarded = billing.queue.show(entry)
    assert discarded.status == "discarded"
    assert (discarded.history[-1].actor, discarded.history[-1].note) == ("console:bob", "no address")


def test_a_job_pages_its_results_and_shows_the_ones_left_in_one_state(console: Console, billing: TriageApp) -> None:
    """A bulk job over many entries: its page shows the results a page at a time (the page refreshes every
    second while it runs), and the ones that failed again on their own."""
    client, csrf = logged_in(console)
    billing.fix()  # bill_rider's 4 entries will resolve; notify's 3 fail again
    r = client.post(console.url + "/bulk/replay", data={"expected": "7", "confirm": "yes", "csrf": csrf})
    assert r.status_code == 200 and re.search(r"/jobs/\d+$", r.url)
    job = r.url
    page = finished(client, job)
    assert "Results 1 to 5 of 7" in page and "page 1 of 2" in page and page.count("<tr><td>") == 5
    assert "4 resolved" in page and "3 open" in page
    page = client.get(job, params={"page": "2"}).text
    assert "Results 6 to 7 of 7" in page and page.count("<tr><td>") == 2

    page = client.get(job, params={"after": "open", "page": "9"}).text
    assert "Results 1 to 3 of 3 left open" in page and "page 1 of" not in page
    rows = re.findall(r"<tr><td>.*?</tr>", page, re.S)
    assert len(rows) == 3 and all("status-open" in row and "no address" in row for row in rows)
    assert sorted(re.findall(r"<code>([0-9a-f-]{36})</code>", page)) == sorted(open_entries(billing, "notify"))
    assert "No entry of this job was left discarded" in client.get(job, params={"after": "discarded"}).text


def test_a_post_from_another_origin_is_refused_even_with_the_token(console: Console, billing: TriageApp) -> None:
    client, csrf = logged_in(console)
    entry = open_entries(billing, "notify")[0]
    r = client.post(f"{console.url}/entries/billing/{entry}/discard", data={"reason": "x", "csrf": csrf},
                    headers={"Origin": "http://attacker.example"}, allow_redirects=False)
    assert r.status_code == 403 and "cross-origin" in r.text
    assert billing.queue.show(entry).status == "open"


def test_a_discard_needs_a_reason_and_a_bulk_action_a_confirmation_of_what_the_preview_showed(
        console: Console, billing: TriageApp) -> None:
    client, csrf = logged_in(console)
    entry = open_entries(billing, "notify")[0]
    r = client.post(f"{console.url}/entries/billing/{entry}/discard", data={"reason": "  ", "csrf": csrf})
    assert r.status_code == 400 and "needs a reason" in r.text

    preview = client.get(console.url + "/bulk/replay", params={"handler": "bill_rider"})
    assert "<strong>4</strong> open or interrupted entries of 4 matching" in preview.text
    form = {"handler": "bill_rider", "expected": "4", "csrf": csrf}
    r = client.post(console.url + "/bulk/replay", data=form)
    assert r.status_code == 400 and "tick the confirmation" in r.text
    # More cells dead-letter between the preview and the confirmation: the console asks again.
    write_trips(billing.url, bills=3, notes=0)
    billing.app.drain(timeout=60)
    r = client.post(console.url + "/bulk/replay", data={**form, "confirm": "yes"})
    assert r.status_code == 409 and "expected 4, now 5" in r.text
    assert len(open_entries(billing, "bill_rider")) == 5
    r = client.post(console.url + "/bulk/discard", data={**form, "expected": "5", "confirm": "yes"})
    assert r.status_code == 400 and "needs a reason" in r.text
    assert len(open_entries(billing, "bill_rider")) == 5


def test_filters_and_paging(console: Console, billing: TriageApp) -> None:
    client, _ = logged_in(console)
    r = client.get(console.url + "/entries")
    assert "Entries 1 to 5 of 7" in r.text and "page 1 of 2" in r.text
    r = client.get(console.url + "/entries", params={"page": "2"})
    assert "Entries 6 to 7 of 7" in r.text
    r = client.get(console.url + "/entries", params={"handler": "notify", "text": "RIDER-1"})
    assert "Entries 1 to 1 of 1" in r.text and "no address for rider-1" in r.text
    r = client.get(console.url + "/entries", params={"error": "declined", "status": "open"})
    assert "Entries 1 to 4 of 4" in r.text
    r = client.get(console.url + "/entries", params={"until": "2000-01-01T00:00"})
    assert "No dead letters match" in r.text
    r = client.get(console.url + "/entries", params={"since": "yesterday"})
    assert r.status_code == 400 and "filter since: &#39;yesterday&#39; is not a time" in r.text
    r = client.get(console.url + "/entries", params={"app": "payroll"})
    assert r.status_code == 400 and "app &#39;payroll&#39; is not one of this console" in r.text
    r = client.get(console.url + "/entries", params={"status": "lost"})
    assert r.status_code == 400 and "filter status" in r.text


def test_pages_are_escaped_framed_by_nothing_and_the_cookie_is_for_this_site_only(tmp_path: Path) -> None:
    app = triage_app(tmp_path, bills=0, notes=0)
    # A message with markup in it must show as text.
    with logstore.open(app.url) as store:
        store.put_cell(uuid.uuid4(), "STATUS", 1, {"rider": "<script>alert(1)</script>", "bad": True})
    app.app.drain(timeout=60)
    with serving({"billing": app.queue}, token=SecretStr(TOKEN)) as running:
        client, _ = logged_in(running)
        cookie = requests.post(running.url + "/login", data={"name": "x", "token": TOKEN},
                               allow_redirects=False).headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        r = client.get(running.url + "/entries")
        assert "<script>" not in r.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in r.text
        assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
        assert "script-src" not in r.headers["Content-Security-Policy"]  # default-src 'none': no script at all
        assert TOKEN not in r.text


def test_logout_ends_the_session(console: Console) -> None:
    client, csrf = logged_in(console)
    r = client.post(console.url + "/logout", data={"csrf": csrf})
    assert r.url.endswith("/login")
    assert client.get(console.url + "/", allow_redirects=False).status_code == 303


def test_metrics_answer_the_token_as_a_bearer_header(console: Console, billing: TriageApp) -> None:
    requests.request("PROPFIND", console.url + "/entries")  # a method the parser knows, the console not
    r = requests.get(console.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    assert "PROPFIND" not in r.text and 'method="other"' in r.text
    assert 'cellstream_console_dead_letters{app="billing",status="open"} 7.0' in r.text
    billing.queue.discard(open_entries(billing, "bill_rider")[0], "refunded by hand")  # no page loaded since
    r = requests.get(console.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert 'cellstream_console_dead_letters{app="billing",status="open"} 6.0' in r.text
    assert 'cellstream_console_dead_letters{app="billing",status="discarded"} 1.0' in r.text
    assert requests.get(console.url + "/metrics", allow_redirects=False).status_code == 303
    assert requests.get(console.url + "/metrics", headers={"Authorization": "Bearer nope"},
                        allow_redirects=False).status_code == 303


def test_without_a_token_the_console_listens_on_loopback_only(billing: TriageApp,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValidationError, match="listens only on loopback"):
        ConsoleConfig(host="0.0.0.0")
    ConsoleConfig(host="0.0.0.0", token=SecretStr(TOKEN))
    assert main(["console", "--app", billing.spec, "--bind", "0.0.0.0:0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "without a token the console listens only on loopback" in err
    with serving({"billing": billing.queue}) as running:
        client = requests.Session()
        r = client.get(running.url + "/login")
        assert 'name="token"' not in r.text and "no token" in r.text
        r = client.post(running.url + "/login", data={"name": "carol"})
        assert r.url == running.url + "/" and "console:carol" in r.text


def test_over_tls_the_console_serves_https_and_the_session_cookie_is_secure(billing: TriageApp,
                                                                             tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN), tls_cert=pki.server.cert,
                 tls_key=pki.server.key) as running:
        assert running.url.startswith("https://")
        r = requests.post(running.url + "/login", data={"name": "dana", "token": TOKEN}, allow_redirects=False,
                          verify=str(pki.ca))
        assert r.status_code == 303 and "Secure" in r.headers["Set-Cookie"]
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(running.url + "/login", verify=str(pki.other_ca))
    with pytest.raises(ValidationError, match="both a certificate and its key"):
        ConsoleConfig(token=SecretStr(TOKEN), tls_cert=pki.server.cert)


def test_cellstream_console_serves_apps_and_connectors_until_sigterm(billing: TriageApp, tmp_path: Path) -> None:
    connector = tmp_path / "lake.yaml"
    connector.write_text("name: lake\ncolumns: [BASE]\nsink: {type: parquet, root: lake}\n")
    argv = [sys.executable, "-m", "cellstream", "console", "--app", billing.spec, "--app", str(connector),
            "--store", billing.url, "--bind", "127.0.0.1:0", "--json"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "CELLSTREAM_CONSOLE_TOKEN": TOKEN})
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline())
        assert started["apps"] == ["billing", "lake"] and started["token_required"] is True
        client = requests.Session()
        r = client.post(started["url"] + "/login", data={"name": "erin", "token": TOKEN})
        assert r.status_code == 200 and "console:erin" in r.text
        r = client.get(started["url"] + "/entries", params={"app": "billing"})
        assert "Entries 1 to 7 of 7" in r.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert TOKEN not in (process.stderr.read() if process.stderr else "")
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("target", [
    "//evil.example", "/\\evil.example", "https://evil.example/", "/\t/evil.example", "/\r/evil.example",
    "/\n/evil.example", "/\t\\evil.example", " //evil.example", "/\x00/evil.example", "\t//evil.example",
])
def test_the_login_redirects_only_to_a_path_of_the_console(console: Console, target: str) -> None:
    """A login link with ``next`` pointing elsewhere (an open redirect, made with characters that URL parsers
    drop after a check on the raw string) lands on the console's start page: the Location, as a browser
    resolves it against the console, is on the console's own host."""
    anonymous = requests.Session()
    r = anonymous.post(console.url + "/login", data={"name": "bob", "token": TOKEN, "next": target},
                       allow_redirects=False)
    assert r.status_code == 303
    resolved = requests.compat.urljoin(console.url + "/login", r.headers["Location"])
    assert resolved.startswith(console.url + "/") and "evil" not in resolved, r.headers["Location"]
