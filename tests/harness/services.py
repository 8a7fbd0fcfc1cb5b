"""Private ZooKeeper and Kafka servers for fault-injection tests.

The shared servers of tests/harness/servers.py (ZooKeeper 2181, Kafka 9092) must never be stopped by a test;
a test that stops, kills or restarts a server gets its own::

    with PrivateZooKeeper(tmp_path / "zk") as zk:     # KazooClient(hosts=zk.hosts)
        zk.kill()
        zk.start()                                    # same port, same data
    with PrivateKafka(tmp_path / "kafka") as kafka:   # bootstrap_servers=kafka.bootstrap
        kafka.restart()

They run from the jars scripts/install.sh fetches into `.services/kafka/lib` (scripts/kafka/pom.xml), on
free 127.0.0.1 ports chosen once so a restart comes back where clients expect it; their data lives in the work
dir and survives stop/kill/start.  Each JVM's stdout/stderr and log4j output go to `<workdir>/<name>.log`.
After a kill, Kafka needs ~15 s to start: the controller refuses the broker's new registration until the old
one's session (broker.session.timeout.ms, 9 s) has expired.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.harness import REPO

LIB_DIR = REPO / ".services" / "kafka" / "lib"
HOST = "127.0.0.1"
START_TIMEOUT = 60.0
KAFKA_START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
LOG_TAIL_LINES = 40

# log4j 1.x (reload4j): everything to stdout, which goes to the instance's log file.
_LOG4J = """\
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
"""


def lib_dir() -> Path:
    """The directory holding the Kafka/ZooKeeper jars; fails clearly if they were never fetched."""
    if not any(LIB_DIR.glob("kafka_2.13-*.jar")) or not any(LIB_DIR.glob("zookeeper-3*.jar")):
        raise RuntimeError(
            f"the Kafka/ZooKeeper jars are missing from {LIB_DIR}; "
            "run scripts/install.sh (`make test` does) to fetch them"
        )
    return LIB_DIR


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def signal_group(proc: subprocess.Popen[bytes] | None, sig: signal.Signals, timeout: float) -> None:
    """Signal a server started in its own session, and wait for it (SIGKILL after ``timeout``)."""
    if proc is None:
        return
    if proc.poll() is None:  # not reaped yet, so the pid (= process group) is still ours
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def zk_four_letter(hosts: str, command: str = "ruok", timeout: float = 3.0) -> str:
    """Send a ZooKeeper four-letter-word command to "host:port"; the answer, or "" on any error."""
    host, _, port = hosts.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(command.encode())
            chunks: list[bytes] = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
    except OSError:
        return ""
    return b"".join(chunks).decode(errors="replace")


def kafka_brokers(bootstrap: str, timeout: float = 10.0) -> list[str]:
    """The "broker N at host:port" lines of `kcat -L`; empty when the broker gives no metadata."""
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat is None:
        raise RuntimeError("kcat is not installed; run scripts/install.sh (`make test` does)")
    try:
        out = subprocess.run(
            [kcat, "-b", bootstrap, "-L", "-t", "__cellstream_probe", "-m", str(int(timeout))],
            capture_output=True, text=True, timeout=timeout + 5, check=False,
        ).stdout
    except subprocess.TimeoutExpired:
        return []
    return [line.strip() for line in out.splitlines() if line.strip().startswith("broker ")]


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise RuntimeError("java is not installed; run scripts/install.sh (`make test` does)")
    return java


class _JavaServer:
    """One JVM started detached in its own session, with its files in `workdir`."""

    name = "server"
    heap = "-Xmx256m"
    start_timeout = START_TIMEOUT

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir.absolute()
        self.log_path = self.workdir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def _prepare(self) -> None:
        """Write config files (and format storage) before a start."""

    def _main(self) -> list[str]:
        """Main class and its arguments."""
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _java_cmd(self, *main: str) -> list[str]:
        return [
            _java(), self.heap, "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{self.workdir / 'log4j.properties'}",
            "-cp", f"{lib_dir()}/*", *main,
        ]

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _fail(self, why: str) -> RuntimeError:
        return RuntimeError(f"{self.name}: {why} (log {self.log_path}):\n{self.log_tail()}")

    def start(self) -> None:
        """Start (no-op when running) and wait until the server answers."""
        if self.running:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "log4j.properties").write_text(_LOG4J)
        self._prepare()
        with self.log_path.open("ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name} =====\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._java_cmd(*self._main()), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir, start_new_session=True,
            )
        (self.workdir / f"{self.name}.pid").write_text(str(self._proc.pid))  # for a stop from another process
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._ready():
                return
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise self._fail(f"the JVM exited with code {code} during startup")
            time.sleep(0.25)
        self.kill()
        raise self._fail(f"not ready after {self.start_timeout:.0f}s")

    def _signal(self, sig: signal.Signals, timeout: float) -> None:
        proc, self._proc = self._proc, None
        signal_group(proc, sig, timeout)

    def stop(self) -> None:
        """Clean shutdown (SIGTERM, SIGKILL after 60 s); safe when not running."""
        self._signal(signal.SIGTERM, STOP_TIMEOUT)

    def kill(self) -> None:
        """Crash it (SIGKILL); safe when not running."""
        self._signal(signal.SIGKILL, 10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class PrivateZooKeeper(_JavaServer):
    """A standalone ZooKeeper on a free port; data (and so sessions) kept across restarts."""

    name = "zookeeper"
    heap = "-Xmx128m"

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        super().__init__(workdir)
        self.port = port or free_port()

    @property
    def hosts(self) -> str:
        return f"{HOST}:{self.port}"

    def _prepare(self) -> None:
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        (self.workdir / "zoo.cfg").write_text(
            "tickTime=2000\n"
            f"dataDir={data}\n"
            f"clientPort={self.port}\n"
            f"clientPortAddress={HOST}\n"
            "maxSessionTimeout=60000\n"
            "maxClientCnxns=0\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=*\n"
        )

    def _main(self) -> list[str]:
        return ["org.apache.zookeeper.server.ZooKeeperServerMain", str(self.workdir / "zoo.cfg")]

    def _ready(self) -> bool:
        # `conf` names the data dir: ours answering, not some other server that took the port.
        if zk_four_letter(self.hosts, "ruok") != "imok":
            return False
        return f"dataDir={self.workdir / 'data'}/" in zk_four_letter(self.hosts, "conf")


@dataclass(frozen=True)
class SecuredListeners:
    """The secured listeners of a PrivateKafka: SASL_SSL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 for ``users``)
    and SSL with client certificates required, both with the server certificate ``keystore`` (key and chain,
    PEM) and trusting the CA file ``truststore``."""

    keystore: Path
    truststore: Path
    users: dict[str, str]


def _jaas_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


class PrivateKafka(_JavaServer):
    """A single-node KRaft Kafka (broker + controller) on free ports; log dir kept across restarts.

    With ``security``, two more listeners: ``sasl_ssl_bootstrap`` and ``ssl_bootstrap`` (see SecuredListeners);
    the plain listener stays for the broker's own use and for readiness checks. ``properties`` override the
    broker's settings (for example ``{"auto.create.topics.enable": "true"}``, off by default here).
    """

    name = "kafka"
    heap = "-Xmx384m"
    start_timeout = KAFKA_START_TIMEOUT

    def __init__(self, workdir: Path, port: int | None = None, controller_port: int | None = None,
                 security: SecuredListeners | None = None, properties: dict[str, str] | None = None) -> None:
        super().__init__(workdir)
        self.properties = dict(properties or {})
        self.port = port or free_port()
        self.controller_port = controller_port or free_port()
        while self.controller_port == self.port:
            self.controller_port = free_port()
        self.security = security
        self.sasl_ssl_port, self.ssl_port = (free_port(), free_port()) if security else (0, 0)

    @property
    def sasl_ssl_bootstrap(self) -> str:
        return f"{HOST}:{self.sasl_ssl_port}"

    @property
    def ssl_bootstrap(self) -> str:
        return f"{HOST}:{self.ssl_port}"

    def _listeners(self) -> str:
        listeners = [f"PLAINTEXT://{self.bootstrap}"]
        if self.security is not None:
            listeners += [f"SASL_SSL://{self.sasl_ssl_bootstrap}", f"SSL://{self.ssl_bootstrap}"]
        return ",".join(listeners)

    def _security_properties(self) -> str:
        sec = self.security
        if sec is None:
            return ""
        plain_users = " ".join(f'user_{name}="{_jaas_string(pw)}"' for name, pw in sec.users.items())
        return (
            "sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512\n"
            "listener.name.sasl_ssl.plain.sasl.jaas.config="
            f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};\n"
            "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required;\n"
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required;\n"
            "ssl.keystore.type=PEM\n"
            f"ssl.keystore.location={sec.keystore}\n"
            "ssl.truststore.type=PEM\n"
            f"ssl.truststore.location={sec.truststore}\n"
            "listener.name.ssl.ssl.client.auth=required\n"
        )

    def _scram_arguments(self) -> list[str]:
        if self.security is None:
            return []
        return [arg for name, pw in self.security.users.items() for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512")
                for arg in ("--add-scram", f"{mechanism}=[name={name},password={pw}]")]

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def _prepare(self) -> None:
        data = self.workdir / "data"
        props = self.workdir / "server.properties"
        props.write_text(
            "process.roles=broker,controller\n"
            "node.id=1\n"
            f"controller.quorum.voters=1@{HOST}:{self.controller_port}\n"
            f"listeners={self._listeners()},CONTROLLER://{HOST}:{self.controller_port}\n"
            f"advertised.listeners={self._listeners()}\n"
            "controller.listener.names=CONTROLLER\n"
            "inter.broker.listener.name=PLAINTEXT\n"
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL\n"
            + self._security_properties() +
            f"log.dirs={data}\n"
            "num.partitions=1\n"
            "auto.create.topics.enable=false\n"
            "offsets.topic.replication.factor=1\n"
            "transaction.state.log.replication.factor=1\n"
            "transaction.state.log.min.isr=1\n"
            "min.insync.replicas=1\n"
            "default.replication.factor=1\n"
            "group.initial.rebalance.delay.ms=0\n"
            "num.network.threads=2\n"
            "num.io.threads=2\n"
            + "".join(f"{name}={value}\n" for name, value in self.properties.items())  # the last one counts
        )
        if (data / "meta.properties").exists():
            return
        shutil.rmtree(data, ignore_errors=True)  # a format interrupted half-way
        cluster_id = "-"
        while cluster_id.startswith("-"):  # what StorageTool random-uuid avoids too
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        with self.log_path.open("ab") as log:
            result = subprocess.run(
                self._java_cmd("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props),
                               *self._scram_arguments()),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=120, check=False,
            )
        if result.returncode != 0 or not (data / "meta.properties").exists():
            raise self._fail(f"formatting {data} failed (exit code {result.returncode})")

    def _main(self) -> list[str]:
        return ["kafka.Kafka", str(self.workdir / "server.properties")]

    def _ready(self) -> bool:
        return bool(kafka_brokers(self.bootstrap, timeout=5))
