"""A PostgreSQL server of the tests' own: the shared one (tests/harness/servers.py, 5432) is this class on a fixed
port; a test that needs other settings (TLS, its own pg_hba.conf rules) starts one on a free port::

    with PrivatePostgreSQL(scratch_dir("pg"), options=["ssl=on", ...], hba=["hostssl all all 127.0.0.1/32 cert"]):
        ...

It runs Debian's newest PostgreSQL (what `make test` installs). As root it runs as the ``postgres`` user, as
PostgreSQL requires, so its work dir must be reachable by that user: :func:`scratch_dir` gives one under
``.services/`` (pytest's tmp_path is private to root). The superuser is cellstream/cellstream; ``hba`` lines
come before the default rules (local trust, host scram-sha-256), so they win.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.harness import REPO
from tests.harness.services import HOST, free_port

USER = PASSWORD = "cellstream"
START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
IS_ROOT = os.geteuid() == 0
SCRATCH = REPO / ".services" / "scratch"


def scratch_dir(name: str) -> Path:
    """A new directory the ``postgres`` user can reach (remove it when done)."""
    path = SCRATCH / f"{name}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    if IS_ROOT:
        for part in (REPO / ".services", SCRATCH):
            part.chmod(0o755)
    return path


def _bin(name: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise RuntimeError(f"postgresql: {name} is not installed: run scripts/install.sh (`make test` does)")
    return str(found[-1])


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


class PrivatePostgreSQL:
    def __init__(self, workdir: Path, port: int | None = None, options: Sequence[str] = (),
                 hba: Sequence[str] = ()) -> None:
        self.workdir = workdir.absolute()
        self.data = self.workdir / "data"
        self.port = port or free_port()
        self.options = list(options)
        self.hba = list(hba)
        self.log_path = self.workdir / "postgresql.log"

    def url(self, database: str, user: str = USER, password: str | None = PASSWORD) -> str:
        auth = f"{user}:{password}" if password is not None else user
        return f"postgresql://{auth}@{HOST}:{self.port}/{database}"

    def own(self, path: Path) -> Path:
        """``path`` made the server's (as root: owned by ``postgres``), e.g. a key it must read."""
        if IS_ROOT:
            shutil.chown(path, "postgres")
        return path

    def _as_postgres(self, *cmd: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *cmd] if IS_ROOT else list(cmd)

    def _initialize(self) -> None:
        if (self.workdir / ".initialized").exists():
            return
        shutil.rmtree(self.data, ignore_errors=True)
        pwfile = self.own_file(self.workdir / ".pw", PASSWORD + "\n")
        try:
            done = subprocess.run(self._as_postgres(
                _bin("initdb"), "-D", str(self.data), "-U", USER, f"--pwfile={pwfile}", "--auth-local=trust",
                "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8"),
                capture_output=True, text=True, timeout=300)
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise RuntimeError(f"postgresql: initdb failed:\n{done.stdout}\n{done.stderr}")
        (self.workdir / ".initialized").touch()

    def own_file(self, path: Path, text: str, mode: int = 0o600) -> Path:
        path.write_text(text)
        path.chmod(mode)
        return self.own(path)

    def start(self) -> None:
        """Start it and wait (pg_ctl -w) until it takes connections."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.own(self.workdir)
        self._initialize()
        if self.hba:
            hba = self.data / "pg_hba.conf"
            default = hba.read_text().split("# cellstream rules end\n")[-1]
            self.own_file(hba, "".join(f"{line}\n" for line in self.hba) + "# cellstream rules end\n" + default)
        self.log_path.touch()
        self.own(self.log_path)
        settings = " ".join(f"-c {option}" for option in
                            [f"listen_addresses={HOST}", "max_connections=200", *self.options])
        done = subprocess.run(self._as_postgres(
            _bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", str(int(START_TIMEOUT)),
            "-o", f"-p {self.port} -k {self.workdir} {settings}", "start"),
            capture_output=True, text=True, timeout=START_TIMEOUT + 10)
        if done.returncode != 0:
            raise RuntimeError(f"postgresql: pg_ctl start failed:\n{done.stderr}\n{_tail(self.log_path)}")

    @property
    def pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        subprocess.run(self._as_postgres(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"),
                       capture_output=True, timeout=STOP_TIMEOUT)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
