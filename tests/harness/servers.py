"""The suite's shared servers, started and stopped from Python: MariaDB (3306) with its replica (3307),
PostgreSQL (5432; 5433 with wal_level=logical, a migration's source), ZooKeeper (2181), Kafka (9092) and
S3Proxy (8333, an S3-compatible object store), at the addresses of tests/harness/shared_servers.py.

The test session starts the ones its tests need (tests/conftest.py) and stops, at its end, exactly those
it started. A server that already answers with the test credentials is reused and left running: one
started by ``python -m tests.harness.servers up`` (kept for a day of test runs), or Docker's
(docker/compose.yml). ``scripts/install.sh`` installs what they run from; nothing here installs.

    python -m tests.harness.servers up [NAME...]       # start (or reuse), leave running
    python -m tests.harness.servers down [NAME...]     # stop the ones started from here
    python -m tests.harness.servers run -- CMD...      # start, run CMD, stop what was started

Each server's files live in ``.services/<name>/`` (kept between runs, so a start is quick); a server
started here writes its pid there, and ``down`` stops a pid only if its command line names that
directory, so it never touches anybody else's server.

Why not pytest-mysql and pytest-postgresql: both start a server per test session on a port of their
own and run it as the invoking user; here the servers are shared with ``up`` and Docker on fixed
ports, MariaDB is started with a replica, and as root PostgreSQL must run as the ``postgres`` user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import pymysql

from tests.harness import REPO
from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.private_postgres import PrivatePostgreSQL
from tests.harness.services import HOST, PrivateKafka, PrivateZooKeeper, _JavaServer, kafka_brokers, zk_four_letter
from tests.harness.shared_servers import S3_CREDENTIAL, S3_IDENTITY, S3_PORT

DIR = REPO / ".services"
USER = PASSWORD = "cellstream"
START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
IS_ROOT = os.geteuid() == 0


def log(message: str) -> None:
    print(f"servers: {message}", file=sys.stderr, flush=True)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


class Server(ABC):
    """One shared server: ``up`` reuses or starts it, ``down`` stops it if it was started from here."""

    name: str
    port: int

    def __init__(self) -> None:
        self.dir = DIR / self.name
        self.pidfile = self.dir / "server.pid"
        self._proc: subprocess.Popen[bytes] | None = None  # when started by this process: reaped after a stop

    @abstractmethod
    def answers(self) -> bool:
        """It takes the test credentials at its address (whoever started it)."""

    @abstractmethod
    def _start(self) -> None:
        """Start it (files in ``self.dir``) and wait until it answers; write its pid to ``self.pidfile``."""

    def _shutdown(self, pid: int) -> None:
        os.kill(pid, signal.SIGTERM)

    def ours(self) -> int | None:
        """The pid of the server started here (its command line names its directory), if it runs."""
        try:
            pid = int(self.pidfile.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            return None
        return pid if str(self.dir) in cmdline and _alive(pid) else None

    def up(self) -> bool:
        """Reuse it if it answers, else start it; True when it was started now."""
        if self.answers():
            log(f"{self.name}: answers on {HOST}:{self.port}, reusing")
            return False
        if _listening(self.port) and self.ours() is None:
            raise RuntimeError(f"{self.name}: {HOST}:{self.port} is in use by something that does not take "
                               f"{USER}/{PASSWORD}; stop it")
        started = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        log(f"{self.name}: starting (files in {self.dir})")
        self._start()
        log(f"{self.name}: started on {HOST}:{self.port} ({time.monotonic() - started:.1f}s)")
        return True

    def down(self) -> None:
        pid = self.ours()
        if pid is None:
            return
        log(f"{self.name}: stopping (pid {pid})")
        with contextlib.suppress(ProcessLookupError):
            self._shutdown(pid)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _alive(pid):
            if time.monotonic() > deadline:
                log(f"{self.name}: still running after {STOP_TIMEOUT:.0f}s, killing")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                deadline += 10
            time.sleep(0.1)
        if self._proc is not None:
            self._proc.wait()
            self._proc = None
        self.pidfile.unlink(missing_ok=True)
        log(f"{self.name}: stopped")


class MariaDB(Server):
    """mariadbd on 3306, writing the row-based binary log its replica reads (the harness's PrivateMariaDB on a
    fixed port, with the shared server's settings)."""

    name = "mariadb"
    port = 3306
    # An hour of binary log is plenty for the replica, which reads it live; days of it filled the disk.
    extra = ["--server-id=1", "--log-bin=mysql-bin", "--binlog-format=ROW", "--binlog-expire-logs-seconds=3600",
             "--max-binlog-size=256M"]

    def answers(self) -> bool:
        with contextlib.suppress(pymysql.Error):
            pymysql.connect(host=HOST, port=self.port, user=USER, password=PASSWORD, connect_timeout=3).close()
            return True
        return False

    def _start(self) -> None:
        # Durability defaults kept (innodb_flush_log_at_trx_commit=1): the benchmarks measure durable puts.
        server = PrivateMariaDB(self.dir, port=self.port, options=[
            "--max-connections=500", "--innodb-buffer-pool-size=512M", "--max-allowed-packet=64M",
            "--character-set-server=utf8mb4", "--collation-server=utf8mb4_unicode_ci", *self.extra])
        server.start()
        self._proc = server._proc


class MariaDBReplica(MariaDB):
    """A second mariadbd on 3307 replicating the primary's ``csr_*`` databases (the tests' replicated ones)."""

    name = "mariadb-replica"
    port = 3307
    extra = ["--server-id=2", "--read-only=1", r"--replicate-wild-do-table=csr\_%.%", "--relay-log=relay-bin"]

    def up(self) -> bool:
        started = super().up()
        self.replicate()
        return started

    def replicate(self) -> None:
        """Have it replicate from the primary (once: it resumes by itself after a restart); wait until it does."""
        def sql(port: int, *statements: str) -> list[dict[str, object]]:
            conn = pymysql.connect(host=HOST, port=port, user=USER, password=PASSWORD, autocommit=True,
                                   connect_timeout=5, cursorclass=pymysql.cursors.DictCursor)
            try:
                with conn.cursor() as cur:
                    for statement in statements:
                        cur.execute(statement)
                    return list(cur.fetchall())
            finally:
                conn.close()
        sql(MariaDB.port, "CREATE USER IF NOT EXISTS 'repl'@'%' IDENTIFIED BY 'repl'",
            "GRANT REPLICATION SLAVE ON *.* TO 'repl'@'%'")
        if not sql(self.port, "SHOW SLAVE STATUS"):
            log(f"{self.name}: replicating from {HOST}:{MariaDB.port}")
            sql(self.port, f"CHANGE MASTER TO MASTER_HOST='{HOST}', MASTER_PORT={MariaDB.port}, MASTER_USER='repl', "
                           "MASTER_PASSWORD='repl', MASTER_USE_GTID=current_pos", "START SLAVE")
        else:
            sql(self.port, "START SLAVE")
        deadline = time.monotonic() + 60
        while True:
            [status] = sql(self.port, "SHOW SLAVE STATUS")
            if status["Slave_IO_Running"] == "Yes" and status["Slave_SQL_Running"] == "Yes":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: replication did not start: {status.get('Last_IO_Error')} "
                                   f"{status.get('Last_SQL_Error')}")
            time.sleep(0.25)


class PostgreSQL(Server):
    """Debian's newest PostgreSQL on 5432; as root it runs as the ``postgres`` user, as PostgreSQL requires."""

    name = "postgresql"
    port = 5432

    def answers(self) -> bool:
        import psycopg

        with contextlib.suppress(psycopg.Error):
            psycopg.connect(host=HOST, port=self.port, user=USER, password=PASSWORD, dbname="postgres",
                            connect_timeout=3).close()
            return True
        return False

    def _start(self) -> None:
        if IS_ROOT:
            DIR.chmod(0o755)
        server = PrivatePostgreSQL(self.dir, port=self.port)
        server.start()
        self.pidfile.write_text(str(server.pid))

    def _shutdown(self, pid: int) -> None:
        PrivatePostgreSQL(self.dir, port=self.port).stop()


class PostgreSQLSource(PostgreSQL):
    """A second PostgreSQL on 5433 with ``wal_level=logical``: the source of the migration tests
    (connectors/migration/sources/postgres.py decodes its log through a replication slot). The shared one on 5432
    keeps ``wal_level=replica``, so a test can see a source refused for it."""

    name = "postgresql-source"
    port = 5433

    def _start(self) -> None:
        if IS_ROOT:
            DIR.chmod(0o755)
        server = PrivatePostgreSQL(self.dir, port=self.port, options=[
            "wal_level=logical", "max_replication_slots=50", "max_wal_senders=20"])
        server.start()
        self.pidfile.write_text(str(server.pid))


class _Java(Server):
    """A JVM server of tests/harness/services.py on its fixed ports, its files in ``.services/<name>``."""

    def __init__(self) -> None:
        super().__init__()
        self.server = self._server()
        self.pidfile = self.dir / f"{self.server.name}.pid"

    @abstractmethod
    def _server(self) -> _JavaServer: ...

    def _start(self) -> None:
        self.server.start()
        self._proc = self.server._proc


class ZooKeeper(_Java):
    name = "zookeeper"
    port = 2181

    def _server(self) -> _JavaServer:
        return PrivateZooKeeper(self.dir, port=self.port)

    def answers(self) -> bool:
        hosts = f"{HOST}:{self.port}"
        return zk_four_letter(hosts, "ruok") == "imok" or zk_four_letter(hosts, "srvr").startswith("Zookeeper version")


class Kafka(_Java):
    """One KRaft node (broker and controller, the controller on 9093)."""

    name = "kafka"
    port = 9092

    def _server(self) -> _JavaServer:
        return PrivateKafka(self.dir, port=self.port, controller_port=9093)

    def answers(self) -> bool:
        return _listening(self.port) and bool(kafka_brokers(f"{HOST}:{self.port}", timeout=5))


class S3Proxy(Server):
    """S3Proxy (the jar scripts/install.sh fetches) on 8333: an S3-compatible server keeping its buckets as
    directories under ``.services/s3proxy/data``, taking AWS v2/v4 signatures of one identity (S3_IDENTITY,
    S3_CREDENTIAL). The test fixture makes its bucket (tests/conftest.py)."""

    name = "s3proxy"
    port = S3_PORT

    def answers(self) -> bool:
        import boto3
        import botocore.config
        import botocore.exceptions

        client = boto3.client("s3", endpoint_url=f"http://{HOST}:{self.port}", region_name="us-east-1",
                              aws_access_key_id=S3_IDENTITY, aws_secret_access_key=S3_CREDENTIAL,
                              config=botocore.config.Config(connect_timeout=2, read_timeout=5,
                                                            retries={"max_attempts": 1}))
        with contextlib.suppress(botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            client.list_buckets()  # signed: a server taking other credentials refuses it
            return True
        return False

    def _start(self) -> None:
        jars = sorted((self.dir / "lib").glob("s3proxy-*-jar-with-dependencies.jar"))
        if not jars:
            raise RuntimeError(f"{self.name}: no jar in {self.dir / 'lib'}; run scripts/install.sh (`make test` does)")
        java = shutil.which("java")
        if java is None:
            raise RuntimeError("java is not installed; run scripts/install.sh (`make test` does)")
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        properties = self.dir / "s3proxy.properties"
        properties.write_text(
            f"s3proxy.endpoint=http://{HOST}:{self.port}\n"
            "s3proxy.authorization=aws-v2-or-v4\n"
            f"s3proxy.identity={S3_IDENTITY}\n"
            f"s3proxy.credential={S3_CREDENTIAL}\n"
            "jclouds.provider=filesystem\n"
            f"jclouds.filesystem.basedir={data}\n")
        log_path = self.dir / "s3proxy.log"
        with log_path.open("ab") as out:
            self._proc = subprocess.Popen(
                [java, "-Xmx256m", "-DLOG_LEVEL=warn", "-jar", str(jars[-1]), "--properties", str(properties)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True)
        self.pidfile.write_text(str(self._proc.pid))
        deadline = time.monotonic() + START_TIMEOUT
        while not self.answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with code {self._proc.returncode}" if self._proc.poll() is not None else "not ready"
                raise RuntimeError(f"{self.name}: {why} (log {log_path}):\n{_tail(log_path)}")
            time.sleep(0.25)


SERVERS: dict[str, type[Server]] = {
    "mariadb": MariaDB, "mariadb-replica": MariaDBReplica, "postgresql": PostgreSQL,
    "postgresql-source": PostgreSQLSource, "zookeeper": ZooKeeper,
    "kafka": Kafka, "s3proxy": S3Proxy,
}
# What each pytest marker needs (tests/conftest.py); the replica needs its primary first.
BY_MARKER = {"mysql": ("mariadb", "mariadb-replica"), "postgres": ("postgresql",),
             "postgres_source": ("postgresql-source",), "zookeeper": ("zookeeper",),
             "kafka": ("kafka",), "s3": ("s3proxy",)}


def up(names: Iterable[str]) -> list[Server]:
    """Reuse or start the servers, in parallel where they do not depend on each other; the ones started now."""
    wanted = [SERVERS[name]() for name in SERVERS if name in set(names)]
    started: list[Server] = []
    errors: list[BaseException] = []

    def chain(servers: Sequence[Server]) -> None:
        for server in servers:
            try:
                if server.up():
                    started.append(server)
            except BaseException as exc:  # reported for all chains at once
                errors.append(exc)
                return
    chains = [[s for s in wanted if s.name.startswith("mariadb")], *([s] for s in wanted
                                                                      if not s.name.startswith("mariadb"))]
    threads = [threading.Thread(target=chain, args=(c,)) for c in chains if c]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        down(started)
        raise RuntimeError("; ".join(str(e) for e in errors))
    return started


def down(servers: Iterable[Server]) -> None:
    for server in reversed(list(servers)):
        server.down()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("up", "down", "run"):
        print(__doc__, file=sys.stderr)
        return 2
    if args[0] == "run":
        command = args[1:][1:] if args[1:2] == ["--"] else args[1:]
        started = up(SERVERS)
        try:
            return subprocess.call(command)
        finally:
            down(started)
    names = args[1:] or list(SERVERS)
    unknown = set(names) - set(SERVERS)
    if unknown:
        print(f"servers: unknown {sorted(unknown)}; known: {list(SERVERS)}", file=sys.stderr)
        return 2
    if args[0] == "up":
        up(names)
    else:
        down(SERVERS[name]() for name in SERVERS if name in names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
