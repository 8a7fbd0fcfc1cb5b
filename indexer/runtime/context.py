"""A handler's context: what it may use besides its cell, handed over when it asks for it.

A handler declared with a second parameter gets one: ``def bill(cell, ctx)`` (or
``def bill_all(cells, ctx)`` for a batch trigger). Through it a handler writes to the app's
store, whichever that is: the one the app was built with, or the temporary one
:class:`indexer.testing.AppHarness` gives it in a test; no module-level store to patch.
"""

from __future__ import annotations

import datetime as dt
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from indexer.errors import ConfigurationError

if TYPE_CHECKING:
    from indexer.runtime.app import App
    from logstore import Store


class Context:
    """One per handler: its app's store and clock, and a logger named after the app and the handler."""

    __slots__ = ("app", "handler", "log")

    def __init__(self, app: App, handler: str) -> None:
        self.app = app
        self.handler = handler
        self.log = logging.getLogger(f"cellstream.app.{app.name}.{handler}")

    @property
    def store(self) -> Store:
        """The app's store: read and write through it (a test harness swaps it for a temporary one)."""
        return self.app.store

    def now(self) -> dt.datetime:
        """The app's time (UTC): real time, or a test's fake clock."""
        return self.app.clock.now()

    def __repr__(self) -> str:
        return f"Context(app={self.app.name!r}, handler={self.handler!r})"


def takes_context(fn: Callable[..., Any], what: str) -> bool:
    """Whether ``fn`` takes a context after its cell (or cells): two required positional parameters. A
    signature that can take neither ``(cell)`` nor ``(cell, ctx)`` is refused here, at registration, rather
    than failing (and dead-lettering) on every cell."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called with the cell alone
        return False
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if not positional or len(required) > 2 or keyword_only:
        raise ConfigurationError(f"{what} {getattr(fn, '__name__', fn)!s}{signature} must take ({_arg(what)}) "
                                 f"or ({_arg(what)}, ctx)")
    return len(required) == 2


def _arg(what: str) -> str:
    return "cells" if what.startswith("batch") else "cell"


def with_context(fn: Callable[..., Any], ctx: Context) -> Callable[[Any], Any]:
    """``fn`` called as ``fn(arg, ctx)``; a coroutine function stays one (the runtime awaits it)."""
    if inspect.iscoroutinefunction(fn):
        async def call_async(arg: Any) -> Any:
            return await fn(arg, ctx)
        return call_async

    def call(arg: Any) -> Any:
        return fn(arg, ctx)
    return call
