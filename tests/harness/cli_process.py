"""A ``cellstream`` command run as a process of its own until something it does is seen, then stopped the way
an operator stops it (SIGTERM), for tests of long-running commands such as ``cellstream tail``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tests.harness import REPO


def run_until(argv: Sequence[str], done: Callable[[], bool], timeout: float = 60.0, poll: float = 0.3) -> str:
    """Run ``cellstream ARGV`` until ``done()``, SIGTERM it, assert that it exited 0; its stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "cellstream", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + timeout
        while not done():
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, f"cellstream {argv[0]} did not get there in {timeout:g}s"
            time.sleep(poll)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    return (out + err).decode()
