"""The console's pages: overview, list, entry, bulk preview, jobs (the console's own, and the store's job
records: compaction and every later long operation), login; the redrive policies' are
:mod:`cellstream.console.redrive`'s. Each renders one template.

A page first reads the dead letters added since the last page (:meth:`Console.refresh`), so it shows
what the request follows: the entries a replay just resolved, a cell dead-lettered a moment ago.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
import urllib.parse
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from aiohttp import web

from cellstream import __version__
from cellstream.console.auth import COOKIE, SESSION, session_of
from cellstream.console.catalog import Query, timeline
from cellstream.console.redrive import RedriveViews
from cellstream.errors import LoginError, LoginThrottled
from indexer.errors import EntryNotFoundError, InvalidFilterError
from indexer.runtime.dlq_store import OPEN_STATES, STATUSES
from indexer.runtime.dlq_triage import DLQFilter
from logstore.errors import CellstreamError, InvalidArgumentError, JobNotFoundError, JobStateError
from logstore.jobs import JobRecord
from logstore.jobs.records import ACTIVE_STATES, FINAL_STATES
from logstore.node.guard import retry_after

if TYPE_CHECKING:
    from cellstream.console.jobs import Kind
    from cellstream.console.server import Console

logger = logging.getLogger(__name__)
FILTER_FIELDS = ("app", "handler", "status", "error", "fingerprint", "text", "since", "until")
_PREVIEW = 20
_GROUPS = 50
_FAILED_LOGIN_DELAY = 0.5  # seconds: slows guessing the token down without hurting a person who mistyped


def parse_filter(params: Mapping[str, str], apps: list[str]) -> tuple[Query, dict[str, str]]:
    """The list's filter from a query string or a form; also the fields as given (for the form and links).
    InvalidFilterError names the field that is wrong."""
    given = {name: str(params.get(name, "")).strip() for name in FILTER_FIELDS}
    given = {name: value for name, value in given.items() if value}
    app = given.get("app")
    if app is not None and app not in apps:
        raise InvalidFilterError(f"app {app!r} is not one of this console's apps ({', '.join(apps)})")
    fields: dict[str, Any] = {k: v for k, v in given.items() if k != "app"}
    for name in ("since", "until"):
        if name in fields:
            fields[name] = _utc(name, fields[name])
    return Query(app, DLQFilter.build(**fields)), given


def _utc(name: str, text: str) -> dt.datetime:
    """A time from the form's ``datetime-local`` field (no zone: UTC, as the console shows every time) or ISO."""
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidFilterError(f"filter {name}: {text!r} is not a time like 2026-11-25T14:30") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _local_path(target: str | None) -> str:
    """Where to go after the login: a path of this console, never another site (an open redirect).

    Checked as a URL parser reads it, not on the raw string: parsers drop tabs and line breaks, and browsers
    read a backslash as a slash, so ``/<TAB>/evil.example`` passed a check of its first characters and
    became ``//evil.example``. A target with a control character, white space or a backslash is refused.
    """
    if not target or any(c <= " " or c in "\\\x7f" for c in target):
        return "/"
    parts = urllib.parse.urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path.startswith("/") or parts.path.startswith("//"):
        return "/"
    return target


class Views:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("cellstream.console", "templates"),
                                      autoescape=True, undefined=jinja2.StrictUndefined)
        self.env.filters["when"] = _when
        self.env.filters["pretty"] = lambda doc: json.dumps(doc, indent=2, ensure_ascii=False, sort_keys=True)
        self.env.globals["url"] = self._url

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.overview)
        r.add_get("/entries", self.entries)
        r.add_get("/entries/{app}/{id}", self.entry)
        r.add_post("/entries/{app}/{id}/replay", self.replay_one)
        r.add_post("/entries/{app}/{id}/discard", self.discard_one)
        r.add_get("/bulk/{kind:replay|discard}", self.bulk_preview)
        r.add_post("/bulk/{kind:replay|discard}", self.bulk_start)
        r.add_get("/jobs", self.jobs)
        r.add_get(r"/jobs/{id:\d+}", self.job)
        r.add_post(r"/jobs/{id:\d+}/cancel", self.cancel)
        r.add_get("/store-jobs/{id:[A-Za-z0-9-]{1,64}}", self.store_job)
        r.add_post("/store-jobs/{id:[A-Za-z0-9-]{1,64}}/{action:pause|resume|cancel|throttle}", self.steer_store_job)
        RedriveViews(self).routes(app)
        r.add_get("/login", self.login_page)
        r.add_post("/login", self.login)
        r.add_post("/logout", self.logout)
        r.add_static("/static", Path(str(files("cellstream.console") / "static")))

    @staticmethod
    def _url(path: str, params: Mapping[str, Any] | None = None, **more: Any) -> str:
        query = {k: v for k, v in {**(params or {}), **more}.items() if v not in (None, "")}
        return path + ("?" + urllib.parse.urlencode(query) if query else "")

    def render(self, request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
        session = request.get(SESSION)
        page = self.env.get_template(template).render(
            session=session, apps=self.console.catalog.apps, store=self.console.store_label, version=__version__,
            token_required=self.console.sessions.token_required, path=request.path, **context)
        return web.Response(text=page, status=status, content_type="text/html")

    # -- overview and list ----------------------------------------------------------
    async def overview(self, request: web.Request) -> web.Response:
        await self.console.refresh()
        catalog = self.console.catalog
        now = dt.datetime.now(dt.UTC)
        step, buckets = timeline(catalog.snapshot(), now)
        tallest = max((b.entries for b in buckets), default=0) or 1
        return self.render(request, "overview.html", counts=catalog.counts(), groups=catalog.groups()[:_GROUPS],
                           buckets=buckets, tallest=tallest, step=_step_label(step), total=len(catalog))

    async def entries(self, request: web.Request) -> web.Response:
        await self.console.refresh()
        try:
            query, given = parse_filter(request.query, self.console.catalog.apps)
        except InvalidFilterError as exc:
            return self.render(request, "entries.html", 400, error=str(exc), given=dict(request.query),
                               entries=[], total=0, page=1, pages=1, first=0, statuses=STATUSES, open_count=0,
                               handlers=self._handlers())
        found = self.console.catalog.query(query)
        page, pages, first, size = self._paging(request, len(found))
        return self.render(request, "entries.html", given=given, entries=found[first:first + size],
                           total=len(found), page=page, pages=pages, first=first, statuses=STATUSES,
                           open_count=sum(1 for e in found if e.status in OPEN_STATES), handlers=self._handlers(),
                           error=None)

    def _handlers(self) -> list[str]:
        return sorted({name for queue in self.console.queues.values() for name in queue.handlers()})

    # -- one entry ------------------------------------------------------------------
    async def entry(self, request: web.Request, *, error: str | None = None, status: int = 200) -> web.Response:
        await self.console.refresh()
        app, entry_id = request.match_info["app"], request.match_info["id"]
        queue = self.console.queues.get(app)
        if queue is None:
            raise web.HTTPNotFound(text=f"no app {app} in this console")
        try:
            entry = await asyncio.to_thread(queue.show, entry_id)
        except EntryNotFoundError as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        lines = entry.traceback.rstrip().splitlines()
        return self.render(request, "entry.html", status, entry=entry, traceback=lines,
                           can_act=entry.status in OPEN_STATES, error=error)

    async def replay_one(self, request: web.Request) -> web.StreamResponse:
        app, entry_id = request.match_info["app"], request.match_info["id"]
        if app not in self.console.queues:
            raise web.HTTPNotFound(text=f"no app {app} in this console")
        return self._start(request, "replay", [(app, entry_id)], f"entry {entry_id} of {app}")

    async def discard_one(self, request: web.Request) -> web.StreamResponse:
        app, entry_id = request.match_info["app"], request.match_info["id"]
        if app not in self.console.queues:
            raise web.HTTPNotFound(text=f"no app {app} in this console")
        reason = str((await request.post()).get("reason", "")).strip()
        if not reason:
            return await self.entry(request, error="a discard needs a reason: say why this entry will not be "
                                                   "processed", status=400)
        return self._start(request, "discard", [(app, entry_id)], f"entry {entry_id} of {app}", reason)

    # -- bulk actions ---------------------------------------------------------------
    async def bulk_preview(self, request: web.Request) -> web.Response:
        await self.console.refresh()
        return self._preview(request, request.match_info["kind"], request.query)

    def _preview(self, request: web.Request, kind: str, params: Mapping[str, Any], status: int = 200,
                 error: str | None = None, reason: str = "") -> web.Response:
        try:
            query, given = parse_filter(params, self.console.catalog.apps)
        except InvalidFilterError as exc:
            return self.render(request, "bulk.html", 400, kind=kind, error=str(exc), given={}, targets=[],
                               matching=0, reason=reason, sample=[])
        found = self.console.catalog.query(query)
        targets = [e for e in found if e.status in OPEN_STATES]
        return self.render(request, "bulk.html", status, kind=kind, error=error, given=given, targets=targets,
                           matching=len(found), sample=targets[:_PREVIEW], reason=reason)

    async def bulk_start(self, request: web.Request) -> web.StreamResponse:
        kind: Kind = "replay" if request.match_info["kind"] == "replay" else "discard"
        form = await request.post()
        params = {k: str(v) for k, v in form.items() if k in FILTER_FIELDS}
        reason = str(form.get("reason", "")).strip()
        await self.console.refresh()
        try:
            query, given = parse_filter(params, self.console.catalog.apps)
        except InvalidFilterError:
            return self._preview(request, kind, params)
        targets = [e for e in self.console.catalog.query(query) if e.status in OPEN_STATES]
        if form.get("confirm") != "yes":
            return self._preview(request, kind, params, 400, "tick the confirmation to go ahead", reason)
        if kind == "discard" and not reason:
            return self._preview(request, kind, params, 400, "a discard needs a reason: say why these entries "
                                                              "will not be processed", reason)
        expected = str(form.get("expected", ""))
        if str(len(targets)) != expected:
            # The matching set moved between the preview and the confirmation: confirm what is there now.
            return self._preview(request, kind, params, 409, f"the entries matching changed since the preview "
                                 f"(expected {expected}, now {len(targets)}): check and confirm again", reason)
        description = " ".join(f"{k}={v}" for k, v in given.items()) or "every entry"
        return self._start(request, kind, [(e.app, e.id) for e in targets], description, reason or None)

    def _start(self, request: web.Request, kind: Kind, targets: list[tuple[str, str]], description: str,
               reason: str | None = None) -> web.StreamResponse:
        session = session_of(request)
        job = self.console.jobs.start(kind, targets, actor=session.actor, description=description, reason=reason)
        raise web.HTTPSeeOther(f"/jobs/{job.id}")

    # -- jobs ---------------------------------------------------------------------
    async def jobs(self, request: web.Request) -> web.Response:
        """The console's replays and discards, then the store's jobs not over (``?all=1``: every one)."""
        show_all = request.query.get("all") == "1"
        records: list[JobRecord] = []
        store_error = None
        try:
            records = await self._store_jobs()
        except CellstreamError as exc:  # the store away: the console's own jobs are still worth showing
            store_error = f"the store's jobs could not be read: {exc}"
        shown = [r for r in reversed(records) if show_all or r.state not in FINAL_STATES]  # newest first
        return self.render(request, "jobs.html", jobs=sorted(self.console.jobs.jobs.values(), key=lambda j: -j.id),
                           store_jobs=shown, over=sum(1 for r in records if r.state in FINAL_STATES),
                           show_all=show_all, store_error=store_error, now=dt.datetime.now(dt.UTC))

    async def _store_jobs(self) -> list[JobRecord]:
        # One read of what the jobs shard got since the last page (JobStore keeps its place), off the event loop.
        return await asyncio.to_thread(self.console.store_jobs.jobs)

    async def _store_job(self, job_id: str) -> JobRecord:
        """The job's latest record; 404 for an id the store has no job of (looked up in the listing, so an
        unknown id costs no read of its own and leaves nothing cached)."""
        record = next((r for r in await self._store_jobs() if r.id == job_id), None)
        if record is None:
            raise web.HTTPNotFound(text=f"no job {job_id} in this store")
        return record

    async def store_job(self, request: web.Request, *, record: JobRecord | None = None, error: str | None = None,
                        status: int = 200) -> web.Response:
        """A store job's record: its state, owner and lease, throttle and steps, and the forms that steer it."""
        if record is None:
            record = await self._store_job(request.match_info["id"])
        return self.render(request, "store_job.html", status, job=record, error=error, now=dt.datetime.now(dt.UTC),
                           active=record.state in ACTIVE_STATES, final=record.state in FINAL_STATES)

    async def steer_store_job(self, request: web.Request) -> web.StreamResponse:
        """Pause, resume, cancel or throttle a store job, as ``cellstream jobs`` does (the record changes; the
        job's runner acts on it after its current chunk). A state that refuses the change shows why (409)."""
        job_id, action = request.match_info["id"], request.match_info["action"]
        record = await self._store_job(job_id)
        jobs = self.console.store_jobs
        try:
            if action == "throttle":
                rate = _rate((await request.post()).get("rate"))
                changed = await asyncio.to_thread(jobs.set_throttle, job_id, rate=rate)
            else:
                command = {"pause": jobs.pause, "resume": jobs.resume, "cancel": jobs.cancel}[action]
                changed = await asyncio.to_thread(command, job_id)
        except JobNotFoundError as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        except (JobStateError, InvalidArgumentError) as exc:
            status = 409 if isinstance(exc, JobStateError) else 400
            return await self.store_job(request, record=await self._store_job(job_id), error=str(exc), status=status)
        except CellstreamError as exc:  # the store away: the write may or may not have landed
            return await self.store_job(request, record=record, status=503,
                                        error=f"the store did not answer ({exc}): reload to see whether it changed")
        logger.info("store job %s: %s by %s (state %s)", job_id, action, session_of(request).actor, changed.state)
        raise web.HTTPSeeOther(f"/store-jobs/{job_id}")

    async def job(self, request: web.Request) -> web.Response:
        """A job's progress, and its per-entry results a page at a time (``after=``: only the entries left in
        that state, say the ones that failed again), so a job over many entries stays cheap to refresh."""
        job = self.console.jobs.jobs.get(int(request.match_info["id"]))
        if job is None:
            raise web.HTTPNotFound(text="no such job (the console keeps the last hundred, until it restarts)")
        after = request.query.get("after") or None
        results = [r for r in job.results if r.after == after] if after else list(job.results)
        page, pages, first, size = self._paging(request, len(results))
        given = {"after": after} if after else {}
        return self.render(request, "job.html", job=job, tally=job.tally(), after=after, given=given,
                           results=results[first:first + size], shown=len(results), page=page, pages=pages,
                           first=first)

    def _paging(self, request: web.Request, total: int) -> tuple[int, int, int, int]:
        """(page, pages, index of the page's first item, page size) for ``total`` items and ``?page=``."""
        size = self.console.config.page_size
        pages = max(1, -(-total // size))
        try:
            page = min(max(1, int(request.query.get("page", "1"))), pages)
        except ValueError:
            page = 1
        return page, pages, (page - 1) * size, size

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        job = self.console.jobs.cancel(int(request.match_info["id"]))
        if job is None:
            raise web.HTTPNotFound(text="no such job")
        raise web.HTTPSeeOther(f"/jobs/{job.id}")

    # -- login ----------------------------------------------------------------------
    async def login_page(self, request: web.Request) -> web.Response:
        return self.render(request, "login.html", next=_local_path(request.query.get("next")), error=None, name="")

    async def login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        name, token = str(form.get("name", "")), str(form.get("token", ""))
        target = _local_path(str(form.get("next", "/")))
        try:
            session = self.console.sessions.login(name, token, request.remote or "")
        except LoginThrottled as exc:
            self.console.metrics.logins.labels("throttled").inc()
            page = self.render(request, "login.html", 429, next=target, error=str(exc), name=name)
            page.headers["Retry-After"] = retry_after(exc.wait)
            return page
        except LoginError as exc:
            self.console.metrics.logins.labels("refused").inc()
            await asyncio.sleep(_FAILED_LOGIN_DELAY)
            return self.render(request, "login.html", 401, next=target, error=str(exc), name=name)
        self.console.metrics.logins.labels("ok").inc()
        response = web.HTTPSeeOther(target)
        response.set_cookie(COOKIE, session.id, httponly=True, samesite="Strict", path="/",
                            secure=self.console.config.tls_cert is not None)
        raise response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        self.console.sessions.logout(session_of(request).id)
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response


def _rate(value: object) -> float | None:
    """The throttle form's rate: units a second, or empty (or ``unlimited``) for no limit.

    Raises:
        InvalidArgumentError: not a finite number above 0.
    """
    text = str(value or "").strip()
    if text in ("", "unlimited"):
        return None
    try:
        rate = float(text)
    except ValueError:
        raise InvalidArgumentError(f"rate {text!r} is not a number (units a second; empty: unlimited)") from None
    if not math.isfinite(rate) or rate <= 0:
        raise InvalidArgumentError(f"rate {text!r}: give a number of units a second above 0 (empty: unlimited)")
    return rate


def _step_label(step: dt.timedelta) -> str:
    minutes = int(step.total_seconds() // 60)
    if minutes < 60:
        return f"{minutes} minute" + ("s" if minutes > 1 else "")
    if minutes < 1440:
        return f"{minutes // 60} hour" + ("s" if minutes >= 120 else "")
    return f"{minutes // 1440} day" + ("s" if minutes >= 2880 else "")

