"""The worker node backend: :func:`logstore.open("http://host:port", token=...)` gives a Store whose one
recorder, :class:`~logstore.backends.http.recorder.HttpRecorder`, speaks the worker node's HTTP API."""

from __future__ import annotations

from typing import TYPE_CHECKING

from logstore.lazy import lazy_exports

if TYPE_CHECKING:
    from logstore.backends.http.recorder import HttpRecorder

__all__ = ["HttpRecorder"]

# Imported on first use: parsing a worker node's URL (target.py) needs no HTTP client.
__getattr__ = lazy_exports(__name__, {"HttpRecorder": "logstore.backends.http.recorder"})
