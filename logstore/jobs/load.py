"""Back-off on the load of storage nodes, for the jobs that compete with traffic (gh-ost's and Vitess's
throttlers): while a replica of a node a chunk touched lags more than ``max_lag_seconds``, or the node's write
latency is above ``max_latency_ms`` (:class:`~logstore.jobs.records.ThrottleSettings`), the job's
:class:`~logstore.jobs.throttle.Throttle` waits between chunks, and says why.

A node's load is what its probe measures (:class:`NodeProbe`); a MySQL/MariaDB node's probe is a heartbeat
(:mod:`logstore.backends.mysql.heartbeat`). A node whose recorder has no probe (SQLite, a worker node reached
over HTTP) is never a reason to wait. A :class:`LoadGuard` probes each node at most every ``interval`` seconds
whatever the number of threads and chunks asking (a node found down: every ``down_recheck`` seconds), and each
probe's waits are bounded by ``timeout``: a guard never hangs on a node that does not answer, it reports it.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from logstore.jobs.records import ThrottleSettings

if TYPE_CHECKING:
    from logstore.store import Store

logger = logging.getLogger(__name__)
PressureCause = Literal["lag", "latency", "down"]


@dataclass(frozen=True)
class ReplicaLag:
    """One replica's lag as a probe found it."""

    replica: str  # host:port
    seconds: float | None  # None: unknown (the replica did not answer: ``error``); inf: it does not replicate
    source: Literal["heartbeat", "seconds_behind_master"] = "heartbeat"
    error: str | None = None


@dataclass(frozen=True)
class NodeLoad:
    """What one probe of a node found."""

    node: str
    latency_ms: float | None = None  # the probe's write, start to commit; None: not measured
    replicas: tuple[ReplicaLag, ...] = ()  # empty when the replicas were not asked
    down: str | None = None  # why the node's primary did not answer; None: it did
    error: str | None = None  # the probe itself failed (a privilege missing, say): no verdict, and no back-off


class NodeProbe(Protocol):
    """Measures one node's load (a backend's)."""

    def probe(self, replicas: bool) -> NodeLoad:
        """(blocking, bounded by the probe's timeout) Time a write on the node's primary, and with
        ``replicas`` read how far each replica lags. Never raises for a node that does not answer: the
        answer says so (``down``)."""

    def close(self) -> None:
        """Close the probe's connections."""


@runtime_checkable
class ProbedRecorder(Protocol):
    """A node recorder whose node can be probed (MySQL/MariaDB's)."""

    def load_probe(self, timeout: float) -> NodeProbe:
        """A probe of the node on connections of its own, each wait bounded by ``timeout`` seconds."""


def _seconds(value: float) -> str:
    """3.4, 12.0, 0.32: a tenth of a second, or two digits below a second (0.3 would read as not above 0.3)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


@dataclass(frozen=True)
class Pressure:
    """Why a chunk must wait (lag, latency), or cannot go on (down)."""

    cause: PressureCause
    node: str
    subject: str  # what is under pressure: "node b", "replica 127.0.0.1:3307 of node b"
    detail: str  # the whole sentence, for the job's record and its log

    @property
    def key(self) -> tuple[str, str]:
        """What stays the same while the same thing holds a job back (the detail's numbers change)."""
        return self.cause, self.subject


@dataclass
class _Node:
    probe: NodeProbe | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    load: NodeLoad | None = None
    at: float = -math.inf  # when it was probed (the guard's clock)
    with_replicas: bool = False  # the last probe read the replicas too
    latencies: deque[float] = field(default_factory=deque)


class LoadGuard:
    """The load of some storage nodes of ``store``, probed when asked and at most every ``interval`` seconds.

    Thread-safe: the threads of one job's step share it; a thread that finds a node's probe under way waits
    for its answer (at most ``timeout``).

    Args:
        store: the store whose nodes are probed (None: a guard that never holds anything back).
        nodes: the nodes :meth:`check` looks at when it is given none (the kind's, for the whole job).
        interval: a node is probed at most this often.
        timeout: bounds each connection, write and read of a probe.
        down_recheck: a node found down is probed again after this long.
        samples: the write latency is the median of this many last probes (one slow write is no load).
        on_probe: called with each probe's answer (metrics).
        clock: monotonic seconds.
    """

    def __init__(self, store: Store | None, nodes: Iterable[str] = (), *, interval: float = 0.5,
                 timeout: float = 2.0, down_recheck: float = 5.0, samples: int = 3,
                 on_probe: Callable[[NodeLoad], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.nodes: tuple[str, ...] = tuple(nodes)
        self.interval = interval
        self.timeout = timeout
        self.down_recheck = down_recheck
        self._samples = samples
        self._on_probe = on_probe
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._closed = False

    def _node(self, name: str) -> _Node | None:
        with self._lock:
            if self._closed:
                return None
            node = self._nodes.get(name)
            if node is None:
                recorder = None if self._store is None else self._store.node_recorder(name)
                if recorder is None:
                    return None  # not (or no longer) a node of the map: nothing to guard; looked up again next time
                probe = recorder.load_probe(self.timeout) if isinstance(recorder, ProbedRecorder) else None
                node = self._nodes[name] = _Node(probe, latencies=deque(maxlen=self._samples))
            return node

    def load(self, name: str, *, replicas: bool = True) -> tuple[NodeLoad, float | None] | None:
        """(blocking, bounded) Node ``name``'s latest load, probed now when the last probe is older than
        ``interval`` (or did not read the replicas and ``replicas`` asks for them), and its write latency
        (the median of the last ``samples`` probes, ms; None: not measured). None when the node has no probe."""
        node = self._node(name)
        if node is None or node.probe is None:
            return None
        with node.lock:
            last = node.load
            age = self._clock() - node.at
            due = (last is None or age >= (self.down_recheck if last.down else self.interval)
                   or (replicas and not node.with_replicas and not last.down))
            if due:
                load = node.probe.probe(replicas)
                node.load, node.at, node.with_replicas = load, self._clock(), replicas
                if load.latency_ms is not None:
                    node.latencies.append(load.latency_ms)
                elif load.down:
                    node.latencies.clear()
                if load.down and (last is None or not last.down):
                    logger.warning("load guard: storage node %s is down: %s", name, load.down)
                elif last is not None and last.down and not load.down:
                    logger.info("load guard: storage node %s answers again", name)
                if load.error and (last is None or last.error != load.error):
                    logger.warning("load guard: cannot probe storage node %s (no back-off for it): %s", name,
                                   load.error)
                before = {r.replica: r for r in last.replicas} if last is not None else {}
                for replica in load.replicas:
                    if replica.seconds is None and (replica.replica not in before
                                                    or before[replica.replica].seconds is not None):
                        # Its lag is unknown: no back-off for it (a replica that is down is not loaded by a job).
                        logger.warning("load guard: replica %s of storage node %s did not answer: %s",
                                       replica.replica, name, replica.error)
                if self._on_probe is not None:
                    self._on_probe(load)
            assert node.load is not None
            latency = statistics.median(node.latencies) if node.latencies and not node.load.down else None
            return node.load, latency

    def check(self, settings: ThrottleSettings, nodes: Iterable[str] | None = None) -> Pressure | None:
        """(blocking, bounded) Whether a chunk touching ``nodes`` (None: :attr:`nodes`) must wait, by
        ``settings``' maximum lag and latency; None when it may go on (or both maximums are off: then nothing
        is probed).

        Returns:
            The first node found down (cause ``down``: the caller decides, a wait would not help), else the
            pressure furthest beyond its maximum (``lag`` or ``latency``), else None.
        """
        max_lag, max_latency = settings.max_lag_seconds, settings.max_latency_ms
        if max_lag is None and max_latency is None:
            return None
        worst: tuple[float, Pressure] | None = None
        for name in self.nodes if nodes is None else nodes:
            found = self.load(name, replicas=max_lag is not None)
            if found is None:
                continue
            load, latency = found
            if load.down:
                return Pressure("down", name, f"node {name}", f"node {name} is down: {load.down}")
            candidates: list[tuple[float, Pressure]] = []
            if max_latency is not None and latency is not None and latency > max_latency:
                candidates.append((latency / max_latency, Pressure(
                    "latency", name, f"node {name}",
                    f"node {name} write latency {latency:.0f} ms > {max_latency:g} ms")))
            for replica in load.replicas if max_lag is not None else ():
                lag = replica.seconds
                if max_lag is None or lag is None or lag <= max_lag:
                    continue
                subject = f"replica {replica.replica} of node {name}"
                detail = (f"{subject} does not replicate ({replica.error})" if math.isinf(lag)
                          else f"{subject} lags {_seconds(lag)} s > {max_lag:g} s")
                candidates.append((lag / max_lag, Pressure("lag", name, subject, detail)))
            for candidate in candidates:
                if worst is None or candidate[0] > worst[0]:
                    worst = candidate
        return None if worst is None else worst[1]

    def down(self, nodes: Iterable[str] | None = None) -> dict[str, str]:
        """(blocking, bounded) The nodes of ``nodes`` (None: :attr:`nodes`) found down, and why: a kind asks
        before it starts on a unit (the rebalance skips the moves that touch one). Nodes without a probe are
        never down here."""
        out: dict[str, str] = {}
        for name in self.nodes if nodes is None else nodes:
            found = self.load(name, replicas=False)
            if found is not None and found[0].down:
                out[name] = found[0].down
        return out

    def close(self) -> None:
        """Close the probes' connections; a closed guard holds nothing back."""
        with self._lock:
            self._closed = True
            nodes, self._nodes = list(self._nodes.values()), {}
        for node in nodes:
            if node.probe is not None:
                with node.lock:
                    node.probe.close()
