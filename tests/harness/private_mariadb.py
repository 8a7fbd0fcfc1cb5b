"""A private MariaDB server for tests that kill it: the shared one (tests/harness/servers.py) must never be stopped.

    with PrivateMariaDB(tmp_path / "db") as db:   # logstore.open(db.url("cells"))
        db.kill()                                 # SIGKILL: a crash, the data dir keeps what was committed
        db.start()                                # same port, same data

It uses the mariadbd that `make test` installs, on a free 127.0.0.1 port chosen once (or ``port``), with its
data dir and error log in the work dir, and the user cellstream/cellstream with every privilege. ``options``
are more mariadbd options (later ones win): the shared servers of tests/harness/servers.py are started this way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import pymysql

from tests.harness.services import HOST, free_port, signal_group

START_TIMEOUT = 60.0


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name)
                                            if p.exists()), None)
        if found:
            return found
    raise RuntimeError(f"{names[0]} is not installed: run scripts/install.sh (`make test` does)")


class PrivateMariaDB:
    def __init__(self, workdir: Path, port: int | None = None, options: Sequence[str] = ()) -> None:
        self.workdir = workdir.absolute()
        self.data = self.workdir / "data"
        self.socket = Path(f"/tmp/cs-mariadb-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")  # short: sun_path limit
        self.port = port or free_port()
        self.options = list(options)
        self.log_path = self.workdir / "error.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        return f"mysql://cellstream:cellstream@{HOST}:{self.port}/{database}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _user(self) -> list[str]:
        return ["--user=root"] if os.geteuid() == 0 else []

    def _initialize(self) -> None:
        marker = self.workdir / ".initialized"
        if marker.exists():
            return
        shutil.rmtree(self.data, ignore_errors=True)  # never initialized, or interrupted half-way
        self.workdir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([_binary("mariadb-install-db", "mysql_install_db"), "--no-defaults",
                               f"--datadir={self.data}", "--auth-root-authentication-method=normal",
                               "--skip-test-db", "--skip-name-resolve", *self._user()],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed:\n{done.stdout}\n{done.stderr}")
        marker.touch()

    def start(self) -> None:
        """Start (no-op when running) and wait until cellstream can log in over TCP."""
        if self.running:
            return
        self._initialize()
        # Its own tmpdir: a mariadbd deletes every #sql file of its tmpdir when it starts, so one sharing /tmp
        # removes the on-disk temporary tables of the servers running queries meanwhile.
        tmpdir = self.workdir / "tmp"
        tmpdir.mkdir(exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [_binary("mariadbd", "mysqld"), "--no-defaults", f"--datadir={self.data}", f"--tmpdir={tmpdir}",
                 f"--port={self.port}",
                 f"--bind-address={HOST}", f"--socket={self.socket}", f"--log-error={self.log_path}",
                 "--skip-name-resolve", "--innodb-buffer-pool-size=64M", "--max-connections=200", *self.options,
                 *self._user()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (self.workdir / "server.pid").write_text(str(self._proc.pid))  # for a stop from another process
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited during startup:\n{self._tail()}")
            if self.socket.exists():
                with contextlib.suppress(pymysql.Error):
                    self._grant()  # idempotent: a data dir from an earlier run has the user already
                    pymysql.connect(host=HOST, port=self.port, user="cellstream", password="cellstream",
                                    connect_timeout=2).close()
                    return
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"mariadbd not ready after {START_TIMEOUT:.0f}s:\n{self._tail()}")

    def _grant(self) -> None:
        root = pymysql.connect(unix_socket=str(self.socket), user="root", autocommit=True, connect_timeout=2)
        try:
            with root.cursor() as cur:
                for host in ("%", "localhost"):
                    cur.execute(f"CREATE USER IF NOT EXISTS 'cellstream'@'{host}' IDENTIFIED BY 'cellstream'")
                    cur.execute(f"GRANT ALL PRIVILEGES ON *.* TO 'cellstream'@'{host}' WITH GRANT OPTION")
        finally:
            root.close()

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        return "(no log)"

    def _signal(self, sig: signal.Signals, timeout: float) -> None:
        proc, self._proc = self._proc, None
        signal_group(proc, sig, timeout)

    def kill(self) -> None:
        """Crash it (SIGKILL); safe when not running."""
        self._signal(signal.SIGKILL, 10)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, 60)
        self.socket.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
