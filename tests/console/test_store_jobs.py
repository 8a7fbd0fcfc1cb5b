"""The store's job records (compaction and every later long operation) in the console: the second section of
the jobs page, a job's page with its steps and throttle, and the forms that pause, resume, cancel and throttle
it, behind the same session and CSRF checks as every other action. The records are written through a store
handle of their own, as the process running a job (``cellstream connect compact``) writes them."""

from __future__ import annotations

import datetime as dt
import html
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from pydantic import SecretStr

import logstore
from cellstream.console import Console
from logstore.jobs import JobRecord, JobStore, StepRecord
from tests.console.support import TriageApp, serving, triage_app
from tests.console.test_server import TOKEN, logged_in

HOSTILE = '<script>alert("x")</script>'


@pytest.fixture
def billing(tmp_path: Path) -> TriageApp:
    return triage_app(tmp_path, bills=3, notes=1)


@pytest.fixture
def console(billing: TriageApp) -> Iterator[Console]:
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN)) as running:
        yield running


@pytest.fixture
def jobs(billing: TriageApp) -> Iterator[JobStore]:
    """The job records through a handle of the store other than the console's."""
    with logstore.open(billing.url) as store:
        yield JobStore(store)


def create(jobs: JobStore, kind: str = "compact") -> JobRecord:
    return jobs.create(kind, {"config": "lake.yaml", "note": HOSTILE},
                       [StepRecord(name="BASE", total=10), StepRecord(name=f"FARE {HOSTILE}", total=None)],
                       unit="files")


def running(jobs: JobStore, job_id: str) -> JobRecord:
    """The job as a live runner holding it half-way through would have written it."""
    def run(record: JobRecord) -> None:
        at = dt.datetime.now(dt.UTC)
        record.state, record.owner, record.started_at = "running", "host-a:4242:9f1c", at
        record.lease_expires = at + dt.timedelta(minutes=5)
        record.steps[0].state, record.steps[0].done = "done", 10
        record.steps[1].state, record.steps[1].done, record.steps[1].attempts = "running", 3, 1
        record.steps[1].error = record.error = f"StorageUnavailableError: {HOSTILE}"
    return jobs.change(job_id, run)


def row_of(page: str, job_id: str) -> str:
    found = re.search(rf'<tr><td><a href="/store-jobs/{job_id}">.*?</tr>', page, re.S)
    assert found, f"no row for {job_id}"
    return found.group(0)


def text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def test_the_jobs_page_lists_the_store_jobs_and_a_job_page_shows_its_steps(console: Console,
                                                                            jobs: JobStore) -> None:
    client, _ = logged_in(console)
    job = running(jobs, create(jobs).id)
    over = jobs.cancel(create(jobs).id)
    page = client.get(console.url + "/jobs").text
    assert "Long operations (store jobs)" in page
    row = text(row_of(page, job.id))
    assert row.startswith(f"{job.id} compact running 13 / ? files 1 / 2 host-a:4242:9f1c")
    assert f"StorageUnavailableError: {HOSTILE}" in row
    assert f"/store-jobs/{over.id}" not in page and "Also the 1 over" in page  # a job over: behind ?all=1
    assert "cancelled" in text(row_of(client.get(console.url + "/jobs?all=1").text, over.id))

    r = client.get(f"{console.url}/store-jobs/{job.id}")
    assert r.status_code == 200
    steps = re.search(r'<table class="results" id="steps">.*?</table>', r.text, re.S)
    assert steps
    rows = [text(m) for m in re.findall(r"<tr><td>.*?</tr>", steps.group(0), re.S)]
    assert rows == ["1 BASE done 10 / 10 0", f"2 FARE {HOSTILE} running 3 / ? 1 StorageUnavailableError: {HOSTILE}"]
    assert "unlimited, burst 1 s, concurrency 1" in text(r.text)
    assert 'id="pause"' in r.text and 'id="cancel"' in r.text and 'id="resume"' not in r.text
    # Everything the records hold is escaped: the step names, errors and parameters a kind or a store gave.
    assert HOSTILE not in r.text and HOSTILE not in page
    assert "&lt;script&gt;alert(" in r.text


def test_an_unknown_job_is_a_404(console: Console, jobs: JobStore) -> None:
    client, csrf = logged_in(console)
    create(jobs)
    for path in ("/store-jobs/compact-000000", "/store-jobs/no%20such", "/store-jobs/" + "a" * 65):
        assert client.get(console.url + path).status_code == 404
    r = client.post(console.url + "/store-jobs/compact-000000/pause", data={"csrf": csrf}, allow_redirects=False)
    assert r.status_code == 404 and "no job compact-000000" in r.text


def test_pause_resume_throttle_and_cancel_through_the_forms_change_the_record(console: Console,
                                                                              jobs: JobStore) -> None:
    client, csrf = logged_in(console)
    job_id = create(jobs).id
    url = f"{console.url}/store-jobs/{job_id}"

    def post(action: str, **form: str) -> requests.Response:
        return client.post(f"{url}/{action}", data={"csrf": csrf, **form}, allow_redirects=False)

    r = post("pause")
    assert r.status_code == 303 and r.headers["Location"] == f"/store-jobs/{job_id}"
    assert jobs.get(job_id).state == "paused"
    assert 'id="state">paused' in client.get(url).text
    assert post("resume").status_code == 303 and jobs.get(job_id).state == "planned"
    assert post("throttle", rate="250").status_code == 303 and jobs.get(job_id).throttle.rate == 250
    assert "250 files/s" in client.get(url).text
    for bad in ("-1", "inf", "fast"):
        r = post("throttle", rate=bad)
        assert r.status_code == 400 and f"rate {bad!r}" in html.unescape(r.text), bad
    assert jobs.get(job_id).throttle.rate == 250
    assert post("throttle", rate="").status_code == 303 and jobs.get(job_id).throttle.rate is None

    # A running job whose runner is alive stops after its chunk: cancelling, until the runner says cancelled.
    running(jobs, job_id)
    assert post("cancel").status_code == 303 and jobs.get(job_id).state == "cancelling"
    jobs.change(job_id, lambda record: setattr(record, "state", "cancelled"))
    # A state that refuses the change (a page left open while someone else cancelled): its reason, not a 500.
    for action in ("resume", "pause", "throttle"):
        r = post(action, rate="5")
        assert r.status_code == 409, action
        assert f"job {job_id} is cancelled" in html.unescape(r.text) and 'role="alert"' in r.text
    assert jobs.get(job_id).state == "cancelled" and jobs.get(job_id).throttle.rate is None


def test_an_action_needs_a_session_and_its_csrf_token(console: Console, jobs: JobStore) -> None:
    job = create(jobs)
    url = f"{console.url}/store-jobs/{job.id}"
    client, csrf = logged_in(console)
    _, other_csrf = logged_in(console, "eve")
    for action in ("pause", "cancel", "throttle"):
        for data in ({}, {"csrf": "forged"}, {"csrf": other_csrf}):
            r = client.post(f"{url}/{action}", data={**data, "rate": "1"}, allow_redirects=False)
            assert r.status_code == 403 and "CSRF" in r.text, (action, data)
        # No session (logged out, expired, a scraper with the token): refused whatever the form holds.
        anonymous = requests.post(f"{url}/{action}", data={"csrf": csrf, "rate": "1"}, allow_redirects=False,
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert anonymous.status_code == 403 and "log in first" in anonymous.text
        assert requests.get(url, allow_redirects=False).status_code == 303  # to the login
    after = jobs.get(job.id)
    assert (after.revision, after.state, after.throttle.rate) == (job.revision, "planned", None)


class ThreadNotingJobStore(JobStore):
    """A JobStore that notes the thread of every read of the records."""

    threads: set[str]

    def jobs(self) -> list[JobRecord]:
        self.threads.add(threading.current_thread().name)
        return super().jobs()

    def get(self, job_id: str) -> JobRecord:
        self.threads.add(threading.current_thread().name)
        return super().get(job_id)


def test_the_records_are_read_and_changed_off_the_event_loop(billing: TriageApp, jobs: JobStore) -> None:
    job_id = create(jobs).id
    noting = ThreadNotingJobStore(billing.queue.deadletters.store)
    noting.threads = set()
    with serving({"billing": billing.queue}, job_store=noting, token=SecretStr(TOKEN)) as console:
        client, csrf = logged_in(console)
        assert job_id in client.get(console.url + "/jobs").text
        assert client.get(f"{console.url}/store-jobs/{job_id}").status_code == 200
        r = client.post(f"{console.url}/store-jobs/{job_id}/pause", data={"csrf": csrf}, allow_redirects=False)
        assert r.status_code == 303 and jobs.get(job_id).state == "paused"
    assert noting.threads and "console" not in noting.threads  # support.serving's event loop thread
