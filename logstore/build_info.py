"""What is running: cellstream's version (from the installed distribution: the package holding the version,
``cellstream``, is the top layer, which nothing below may import) and the ``cellstream_build_info`` metric
every registry cellstream makes carries, so a dashboard can tell the versions of a fleet apart."""

from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import CollectorRegistry, Info


def version() -> str:
    try:
        return metadata.version("cellstream")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def register_build_info(registry: CollectorRegistry, component: str) -> None:
    """``cellstream_build_info{version, python, component} 1`` in ``registry``."""
    Info("cellstream_build", "cellstream's version, the Python running it and the component", registry=registry
         ).info({"version": version(), "python": platform.python_version(), "component": component})
