"""The console's redrive-policy pages: each app's policy in force (and its declaration, and who changed it when),
and the form that changes it, as ``cellstream dlq policy set`` does. The apps read the policy from the store at
every check (:mod:`indexer.runtime.redrive`), so a change here takes effect within the policy's ``interval``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web

from cellstream.console.auth import session_of
from indexer.errors import InvalidPolicyError
from indexer.runtime.redrive import PolicyRecord, PolicyStore, RedrivePolicy, parse_assignments
from logstore.errors import CellConflictError, CellstreamError

logger = logging.getLogger(__name__)
# The form's fields: the policy's, as text (lists comma-separated); `enabled` is a checkbox.
FORM_FIELDS = ("delay", "multiplier", "max_delay", "max_redrives", "handlers", "errors", "retriable", "pattern",
               "interval", "batch")
_NOTE_MAX = 500


def form_policy(form: Mapping[str, Any]) -> RedrivePolicy:
    """The policy a submitted form describes: an empty field takes the field's default (``max_delay``,
    ``pattern``: none), ``retriable`` is ``any``, ``yes`` or ``no``.

    Raises:
        InvalidPolicyError: a field is missing or has a bad value (named in the message).
    """
    fields: dict[str, Any] = {}
    for name in FORM_FIELDS:
        text = str(form.get(name, "")).strip()
        if not text:
            continue
        if name == "retriable":
            choices = {"any": None, "yes": True, "no": False}
            if text not in choices:
                raise InvalidPolicyError("redrive policy retriable: any, yes or no")
            fields[name] = choices[text]
        elif name == "pattern":
            fields[name] = text
        else:
            fields.update(parse_assignments([f"{name}={text}"]))
    fields["enabled"] = form.get("enabled") == "on"
    return RedrivePolicy.parse(fields)


def policy_form(policy: RedrivePolicy | None) -> dict[str, str]:
    """A policy's fields as the form shows them (none: the defaults, a delay of five minutes)."""
    shown = policy or RedrivePolicy(delay=300, enabled=False)
    values = shown.model_dump()
    out = {name: "" if values[name] is None else f"{values[name]:g}" if isinstance(values[name], float)
           else ", ".join(values[name]) if isinstance(values[name], tuple) else str(values[name])
           for name in FORM_FIELDS if name != "retriable"}
    out["retriable"] = {None: "any", True: "yes", False: "no"}[shown.retriable]
    out["enabled"] = "on" if shown.enabled else ""
    return out


class Pages(Protocol):
    """What the pages need of :class:`cellstream.console.views.Views` (not imported: it imports this module)."""

    console: Any  # the Console: its queues and catalog

    def render(self, request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response: ...


class RedriveViews:
    """``/redrive`` (every app's policy) and ``/redrive/{app}`` (one app's: show, change, reset)."""

    def __init__(self, views: Pages) -> None:
        self.views = views
        self.console = views.console

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/redrive", self.overview)
        r.add_get("/redrive/{app}", self.page)
        r.add_post("/redrive/{app}", self.change)
        r.add_post("/redrive/{app}/reset", self.reset)

    def _policies(self, app: str) -> PolicyStore:
        queue = self.console.queues.get(app)
        if queue is None:
            raise web.HTTPNotFound(text=f"no app {app} in this console")
        return PolicyStore(queue.deadletters)

    async def overview(self, request: web.Request) -> web.Response:
        rows: list[tuple[str, PolicyRecord | None]] = []
        for app in self.console.catalog.apps:
            rows.append((app, await asyncio.to_thread(self._policies(app).get)))
        return self.views.render(request, "redrive_list.html", rows=rows)

    async def page(self, request: web.Request, *, error: str | None = None, status: int = 200,
                   form: Mapping[str, str] | None = None) -> web.Response:
        app = request.match_info["app"]
        policies = self._policies(app)
        history = await asyncio.to_thread(policies.history)
        current = history[-1] if history else None
        return self.views.render(request, "redrive.html", status, app=app, current=current,
                                 history=list(reversed(history)), error=error,
                                 form=form or policy_form(current.policy if current else None))

    async def change(self, request: web.Request) -> web.StreamResponse:
        """Put the form's policy in force, recorded with the session's name and the note."""
        app = request.match_info["app"]
        policies = self._policies(app)
        form = await request.post()
        shown = {name: str(form.get(name, "")) for name in (*FORM_FIELDS, "enabled")}
        note = str(form.get("note", "")).strip()[:_NOTE_MAX] or None
        try:
            policy = form_policy(form)
            actor = session_of(request).actor
            await asyncio.to_thread(policies.set, policy, actor, note)
        except InvalidPolicyError as exc:
            return await self.page(request, error=str(exc), status=400, form=shown)
        except CellConflictError:
            return await self.page(request, error="the policy was changed meanwhile (by the app or another person): "
                                                  "look at it again and resubmit", status=409, form=shown)
        except CellstreamError as exc:
            return await self.page(request, error=f"the store did not answer ({exc}): reload to see whether the "
                                                  "change landed", status=503, form=shown)
        logger.info("app %s: redrive policy changed by %s", app, actor)
        raise web.HTTPSeeOther(f"/redrive/{app}")

    async def reset(self, request: web.Request) -> web.StreamResponse:
        """Put the app's own declaration back in force."""
        app = request.match_info["app"]
        policies = self._policies(app)
        try:
            await asyncio.to_thread(policies.reset, session_of(request).actor)
        except CellConflictError:
            return await self.page(request, error="the policy was changed meanwhile: look at it again", status=409)
        raise web.HTTPSeeOther(f"/redrive/{app}")
