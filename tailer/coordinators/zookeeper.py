"""Workers, leader, assignment, claims and offsets in ZooKeeper (kazoo).

Layout under ``<chroot>/cellstream/tailers/<name>``::

    workers/<worker-id>-<seq>   ephemeral sequential: one per live worker; the lowest is the leader
    assignment                  {"epoch": n, "leader": member, "workers": {member: [shard, ...]}}
    claims/<shard>              ephemeral: the member publishing the shard now
    offsets/<shard>             {"location": added_id, "owner", "token", "epoch", "deadlettered", ...}

A worker publishes a shard only while it holds the shard's claim and its lease (``lease_fraction`` of the session
timeout since its last answered request); claiming rewrites the offset znode, so a commit from the previous owner
fails with FencedError and offsets never move backwards. docs/tailer.md (Guarantees) gives the design.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    ZookeeperError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry
from kazoo.security import make_digest_acl
from pydantic import SecretStr

from logstore.errors import AuthenticationError
from tailer.config import check_zookeeper_auth
from tailer.coordinators.assignment import balance, by_worker
from tailer.errors import CoordinationError, FencedError
from tailer.interfaces import Claim, Coordinator, Offset

logger = logging.getLogger(__name__)
_CALL_TIMEOUT = 5.0
_COMMIT_BATCH = 200  # offsets a commit transaction: about 60 KB, far below ZooKeeper's 1 MB request limit
_CLAIM_BATCH = 200  # shards a claim transaction (a claim and an offset each): about 80 KB


class _Claiming(NamedTuple):
    """A shard's claim ready to send, and what its transaction writes."""

    at: int  # in claim_many's answer
    shard: int
    location: int
    version: int | None  # of its offsets znode; None: none yet
    token: str
    deadlettered: int
    claim: bytes
    offset: bytes

    def granted(self) -> Claim:
        return Claim(self.shard, self.location, 0 if self.version is None else self.version + 1, self.token,
                     self.deadlettered)


def tailer_path(zookeeper: str, name: str) -> tuple[str, str]:
    """(hosts, path of the tailer): ``host:port[,host:port]/chroot`` keeps the chroot in the path."""
    hosts, _, chroot = zookeeper.partition("/")
    chroot = "/" + chroot.strip("/") if chroot.strip("/") else ""
    return hosts, f"{chroot}/cellstream/tailers/{name}"


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _load(raw: bytes | None) -> dict[str, Any]:
    return json.loads(raw) if raw else {}


def _seq(member: str) -> int:
    return int(member.rsplit("-", 1)[1])


def zookeeper_client(hosts: str, timeout: float, auth: SecretStr | None = None, **options: Any) -> KazooClient:
    """A kazoo client. With ``auth`` (``user:password``) it authenticates with ZooKeeper's digest scheme, and
    every znode it creates gets an ACL that gives that user, and nobody else, every permission."""
    if auth is None:
        return KazooClient(hosts=hosts, timeout=timeout, **options)
    user, _, password = check_zookeeper_auth(auth.get_secret_value()).partition(":")
    return KazooClient(hosts=hosts, timeout=timeout, auth_data=[("digest", f"{user}:{password}")],
                       default_acl=[make_digest_acl(user, password, all=True)], **options)


def refused(exc: NoAuthError, path: str, auth: SecretStr | None) -> AuthenticationError:
    who = f"user {auth.get_secret_value().partition(':')[0]!r}" if auth is not None else "an unauthenticated client"
    return AuthenticationError(f"ZooKeeper refused {who} access to {path} ({type(exc).__name__}): its nodes' ACL "
                               "names other credentials (give the right user:password, see docs/security.md)")


def translate(exc: BaseException, what: str) -> CoordinationError:
    return CoordinationError(f"ZooKeeper {what} failed: {type(exc).__name__} {exc}".rstrip())


class ZooKeeperCoordinator(Coordinator):
    """One worker's membership in a tailer, coordinated through ZooKeeper."""

    # Claims and releases block on a round trip per shard: the worker runs them in this many chunks, enough to
    # keep all of the default executor's threads busy.
    coordination_threads = 32

    def __init__(
        self,
        zookeeper: str,
        name: str,
        shard_count: int,
        *,
        session_timeout: float = 10.0,
        lease_fraction: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
        auth: SecretStr | None = None,
        columns: Sequence[str] | None = None,
    ) -> None:
        hosts, self.root = tailer_path(zookeeper, name)
        self._columns = sorted(columns) if columns is not None else None  # kept with the offsets (lag counted)
        self._auth = auth
        self._fatal: AuthenticationError | None = None
        self.worker_id = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}".replace("-", "_")
        self._shard_count = shard_count
        self._session_timeout = session_timeout
        self._lease = session_timeout * lease_fraction
        self._clock = clock
        self._client = zookeeper_client(
            hosts, session_timeout, auth,
            connection_retry=KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=1.0),
        )
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_change: Callable[[], None] = lambda: None
        self._member: str | None = None
        self._info: dict[str, Any] | None = None  # the registration's data
        self._session: int | None = None
        self._generation = 0
        self._epoch = 0
        self._mine: frozenset[int] = frozenset()
        self._leader = False
        self._last_contact: float | None = None
        self._started = False

    def _path(self, *parts: object) -> str:
        return "/".join([self.root, *map(str, parts)])

    # -- lifecycle ------------------------------------------------------------
    def start(self, on_change: Callable[[], None]) -> None:
        if self._started:
            return
        self._started = True
        self._on_change = on_change
        self._client.add_listener(self._on_state)
        self._client.start_async()  # ZooKeeper may be down now; the worker joins when it answers
        self._thread = threading.Thread(target=self._control_loop, name="tailer-zookeeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self._client.stop()  # closing the session deletes our member and claim znodes now
            self._client.close()
        except KazooException as exc:  # pragma: no cover - best effort on shutdown
            logger.warning("closing the ZooKeeper session failed: %s", exc)

    # -- state ----------------------------------------------------------------
    def _on_state(self, state: str) -> None:
        # Runs on kazoo's event thread: no ZooKeeper calls here.
        if self._stopped.is_set():
            return
        if state == KazooState.LOST:
            with self._lock:
                self._member, self._session, self._mine, self._leader = None, None, frozenset(), False
                self._last_contact = None
                self._generation += 1
            logger.warning("ZooKeeper session lost: dropping every shard of worker %s", self.worker_id)
            self._on_change()
        elif state == KazooState.CONNECTED:
            with self._lock:
                self._last_contact = self._clock()
        else:
            logger.warning("ZooKeeper connection suspended; owned shards keep publishing while the lease holds")
        self._wake.set()

    def assignment(self) -> tuple[int, int, frozenset[int]]:
        with self._lock:
            if self._fatal is not None:
                raise self._fatal
            return self._generation, self._epoch, self._mine

    def lease_valid(self) -> bool:
        with self._lock:
            return (self._member is not None and self._last_contact is not None
                    and self._clock() - self._last_contact < self._lease)

    def is_leader(self) -> bool:
        with self._lock:
            return self._leader and self._member is not None

    @property
    def member(self) -> str | None:
        return self._member

    # -- control loop: membership, leadership, assignment ---------------------
    def _watch(self, _event: object) -> None:
        self._wake.set()

    def _control_loop(self) -> None:
        beat = min(1.0, self._session_timeout / 10)
        while not self._stopped.is_set():
            self._wake.wait(beat)
            self._wake.clear()
            if self._stopped.is_set():
                break
            try:
                self._tick()
            except NoAuthError as exc:  # the same every round: stop, and let assignment() raise it
                with self._lock:
                    self._fatal = refused(exc, self.root, self._auth)
                logger.error("%s", self._fatal)
                self._on_change()
                break
            except (KazooException, KazooTimeoutError) as exc:
                logger.debug("ZooKeeper round failed (%s); retrying", type(exc).__name__)
            except Exception:  # keep coordinating whatever happens; the next tick retries
                logger.exception("unexpected error in the ZooKeeper control loop")

    def _tick(self) -> None:
        if self._client.state != KazooState.CONNECTED:
            return
        sent = self._clock()
        session = self._client.client_id[0] if self._client.client_id else None
        if self._member is None or session != self._session or self._client.exists(self._member) is None:
            self._register(session)
        with self._lock:
            self._last_contact = sent  # the server heard from us no earlier than `sent`
        members = sorted(self._client.get_children(self._path("workers"), watch=self._watch), key=_seq)
        member = self._member
        leader = bool(members) and member is not None and self._path("workers", members[0]) == member
        if leader:
            self._rebalance([self._path("workers", m) for m in members])
        raw, _ = self._client.get(self._path("assignment"), watch=self._watch)
        doc = _load(raw)
        mine = frozenset(doc.get("workers", {}).get(member, []))
        with self._lock:
            changed = (mine, doc.get("epoch", 0), leader) != (self._mine, self._epoch, self._leader)
            self._mine, self._epoch, self._leader = mine, int(doc.get("epoch", 0)), leader
        if changed:
            logger.info("worker %s: epoch %s, %d shards%s", self.worker_id, doc.get("epoch", 0), len(mine),
                        " (leader)" if leader else "")
            self._on_change()

    def _register(self, session: int | None) -> None:
        for part in ("workers", "claims", "offsets"):
            self._client.ensure_path(self._path(part))
        if not self._client.exists(self._path("assignment")):
            with contextlib.suppress(NodeExistsError):
                self._client.create(self._path("assignment"), _dump({"epoch": 0, "workers": {}}))
        info = {"worker": self.worker_id, "host": socket.gethostname(), "pid": os.getpid(),
                "joined_at": dt.datetime.now(dt.UTC).isoformat()}
        self._info = info
        path = self._client.create(self._path("workers", self.worker_id + "-"), _dump(info),
                                   ephemeral=True, sequence=True)
        with self._lock:
            if self._member is not None:  # a stale registration: its claims went with its session
                self._generation += 1
            self._member, self._session, self._mine = path, session, frozenset()
            self._generation += 1
        logger.info("worker %s registered as %s", self.worker_id, path)

    def report_published(self, published: Mapping[int, int]) -> None:
        """Kept in this worker's registration (ephemeral: gone with the worker), written without waiting."""
        member, info = self._member, self._info
        if member is None or info is None or self._client.state != KazooState.CONNECTED:
            return
        doc = {**info, "published": {str(shard): location for shard, location in published.items()}}
        with contextlib.suppress(KazooException, KazooTimeoutError):
            self._client.set_async(member, _dump(doc))

    def _rebalance(self, members: list[str]) -> None:
        raw, stat = self._client.get(self._path("assignment"))
        doc = _load(raw)
        current = {s: m for m, shards in doc.get("workers", {}).items() for s in shards}
        owners = balance(range(self._shard_count), members, current)
        if owners == current:
            return
        new = {"epoch": int(doc.get("epoch", 0)) + 1, "leader": self._member, "workers": by_worker(owners),
               "assigned_at": dt.datetime.now(dt.UTC).isoformat()}
        tx = self._client.transaction()
        tx.check(str(self._member), -1)  # only a registered leader may write (any version: it reports progress)
        tx.set_data(self._path("assignment"), _dump(new), version=stat.version)
        results = tx.commit()
        if any(isinstance(r, Exception) for r in results):
            self._wake.set()
            return
        moved = sum(1 for s, m in owners.items() if current.get(s) != m)
        logger.info("leader %s: assignment epoch %d for %d workers, %d shards moved",
                    self.worker_id, new["epoch"], len(members), moved)

    # -- claims and offsets ---------------------------------------------------
    def claim(self, shard: int, initial: Callable[[], int]) -> Claim | None:
        result = self.claim_many([(shard, initial)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def claim_many(self, wanted: Sequence[tuple[int, Callable[[], int]]]) -> list[Claim | BaseException | None]:
        """:meth:`claim` of many shards with their round trips overlapped: every offset read, then the
        claims sent _CLAIM_BATCH shards a transaction before the first answer is awaited. There is no
        separate check that a claim is free: the transaction creating it fails if it is not, and a batch
        refused as a whole (one of its shards held, or its offsets changed meanwhile) is sent again a
        shard a transaction. kazoo spends its Python per request, so the requests per shard are what many
        claims cost (docs/benchmarks.md, the tailer's start)."""
        with self._lock:
            member, epoch = self._member, self._epoch
        out: list[Claim | BaseException | None] = [None] * len(wanted)
        if member is None:
            return out
        deadline = time.monotonic() + _CALL_TIMEOUT

        def left() -> float:
            return max(0.01, deadline - time.monotonic())
        try:
            offsets = [self._client.get_async(self._path("offsets", shard)) for shard, _ in wanted]
        except (KazooException, KazooTimeoutError) as exc:
            return [translate(exc, "claims")] * len(wanted)
        ready: list[_Claiming] = []
        for i, ((shard, initial), offset) in enumerate(zip(wanted, offsets, strict=True)):
            try:
                try:
                    raw, stat = offset.get(timeout=left())
                    doc, version = _load(raw), stat.version
                except NoNodeError:
                    doc, version = {}, None
                location = int(doc["location"]) if "location" in doc else initial()
                token = uuid.uuid4().hex
                doc.update(location=location, owner=member, token=token, epoch=epoch,
                           claimed_at=dt.datetime.now(dt.UTC).isoformat())
                ready.append(_Claiming(i, shard, location, version, token, int(doc.get("deadlettered", 0)),
                                       _dump({"worker": member, "epoch": epoch}), _dump(doc)))
            except (KazooException, KazooTimeoutError) as exc:
                out[i] = translate(exc, f"claim of shard {shard}")
            except Exception as exc:  # initial() could not read the store: this claim is tried again later
                out[i] = exc
        batches = [ready[n:n + _CLAIM_BATCH] for n in range(0, len(ready), _CLAIM_BATCH)]
        alone: list[list[_Claiming]] = []
        for batch, done in self._send_claims(batches, out, left):
            if done:
                for c in batch:
                    out[c.at] = c.granted()
            elif len(batch) > 1:
                alone.extend([c] for c in batch)
        for batch, done in self._send_claims(alone, out, left):
            if done:
                out[batch[0].at] = batch[0].granted()
        return out

    def _send_claims(self, batches: list[list[_Claiming]], out: list[Claim | BaseException | None],
                     left: Callable[[], float]) -> list[tuple[list[_Claiming], bool]]:
        """A transaction per batch, all sent before the first answer is awaited; whether each went through
        (a batch that could not be sent or answered: its shards' errors in ``out``)."""
        sent = []
        for batch in batches:
            tx = self._client.transaction()
            for c in batch:
                tx.create(self._path("claims", c.shard), c.claim, ephemeral=True)
                if c.version is None:
                    tx.create(self._path("offsets", c.shard), c.offset)
                else:
                    tx.set_data(self._path("offsets", c.shard), c.offset, version=c.version)
            try:
                sent.append((batch, tx.commit_async()))
            except (KazooException, KazooTimeoutError) as exc:
                for c in batch:
                    out[c.at] = translate(exc, f"claim of shard {c.shard}")
        answers = []
        for batch, result in sent:
            try:
                results = result.get(timeout=left())
            except (KazooException, KazooTimeoutError) as exc:
                for c in batch:
                    out[c.at] = translate(exc, f"claim of shard {c.shard}")
                continue
            # An error in the results: a claim held, or someone else was first; the whole batch is undone.
            answers.append((batch, not any(isinstance(r, Exception) for r in results)))
        return answers

    def release_many(self, claims: Sequence[Claim]) -> None:
        """:meth:`release` of many shards with their transactions overlapped, and one line for all that failed."""
        if not claims:
            return
        if self._client.state != KazooState.CONNECTED:
            logger.warning("release of %d shards skipped: ZooKeeper unreachable; they free when the session ends",
                           len(claims))
            return
        deadline = time.monotonic() + _CALL_TIMEOUT
        sent = []
        failed: list[str] = []
        for claim in claims:
            tx = self._client.transaction()
            tx.check(self._path("offsets", claim.shard), claim.version)
            tx.delete(self._path("claims", claim.shard))
            try:
                sent.append((claim, tx.commit_async()))
            except (KazooException, KazooTimeoutError) as exc:
                failed.append(f"{claim.shard} ({exc})")
        for claim, result in sent:
            try:
                results = result.get(timeout=max(0.01, deadline - time.monotonic()))
            except (KazooException, KazooTimeoutError) as exc:
                failed.append(f"{claim.shard} ({type(exc).__name__})")
                continue
            if any(isinstance(r, Exception) for r in results):
                failed.append(f"{claim.shard} (refused)")
        if failed:
            logger.warning("release of %d shards failed, e.g. %s; they free when the session ends", len(failed),
                           ", ".join(failed[:5]))

    def commit(self, offsets: Mapping[int, tuple[Claim, Offset]]) -> dict[int, Claim | BaseException]:
        """Every offset written with its claim's version, _COMMIT_BATCH shards a ZooKeeper transaction: with a
        request per shard, kazoo's Python per request would cost more CPU than the cells. A transaction refused
        by one shard (fenced, or a version this worker lost track of) is refused whole and names only that
        shard, so its shards are then written one by one."""
        now = dt.datetime.now(dt.UTC).isoformat()
        docs = {shard: _dump({"location": offset.location, "owner": self._member, "token": claim.token,
                              "epoch": self._epoch, "deadlettered": offset.deadlettered,
                              "last_error": offset.last_error, "updated_at": now,
                              **({} if self._columns is None else {"columns": self._columns})})
                for shard, (claim, offset) in offsets.items()}
        out: dict[int, Claim | BaseException] = {}
        deadline = time.monotonic() + _CALL_TIMEOUT
        shards = list(offsets)
        sent = []
        for start in range(0, len(shards), _COMMIT_BATCH):
            chunk = shards[start:start + _COMMIT_BATCH]
            tx = self._client.transaction()
            for shard in chunk:
                tx.set_data(self._path("offsets", shard), docs[shard], version=offsets[shard][0].version)
            try:
                sent.append((chunk, tx.commit_async()))
            except (KazooException, KazooTimeoutError) as exc:
                out.update((shard, translate(exc, f"commit of shard {shard}")) for shard in chunk)
        one_by_one: list[int] = []
        for chunk, result in sent:
            try:
                answers = result.get(timeout=max(0.01, deadline - time.monotonic()))
            except (ZookeeperError, KazooException, KazooTimeoutError) as exc:
                out.update((shard, translate(exc, f"commit of shard {shard}")) for shard in chunk)
                continue
            if any(isinstance(answer, Exception) for answer in answers):
                one_by_one += chunk
                continue
            for shard, stat in zip(chunk, answers, strict=True):
                claim, offset = offsets[shard]
                out[shard] = claim._replace(version=stat.version, deadlettered=offset.deadlettered)
        pending = {}
        for shard in one_by_one:
            try:
                pending[shard] = self._client.set_async(self._path("offsets", shard), docs[shard],
                                                        version=offsets[shard][0].version)
            except (KazooException, KazooTimeoutError) as exc:
                out[shard] = translate(exc, f"commit of shard {shard}")
        for shard, single in pending.items():
            claim, offset = offsets[shard]
            try:
                stat = single.get(timeout=max(0.01, deadline - time.monotonic()))
                out[shard] = claim._replace(version=stat.version, deadlettered=offset.deadlettered)
            except (BadVersionError, NoNodeError):
                out[shard] = self._recheck(claim)
            except (ZookeeperError, KazooException, KazooTimeoutError) as exc:
                out[shard] = translate(exc, f"commit of shard {shard}")
        return out

    def _recheck(self, claim: Claim) -> Claim | BaseException:
        """After a refused commit: still ours (an earlier commit applied but its reply was lost)?"""
        try:
            raw, stat = self._client.get(self._path("offsets", claim.shard))
        except NoNodeError:
            return FencedError(claim.shard, "its offset znode is gone")
        except (KazooException, KazooTimeoutError) as exc:
            return translate(exc, f"commit of shard {claim.shard}")
        if _load(raw).get("token") == claim.token:
            return claim._replace(version=stat.version)
        return FencedError(claim.shard, "another worker claimed it; its commit was refused")

    def release(self, claim: Claim) -> None:
        if self._client.state != KazooState.CONNECTED:
            logger.warning("release of shard %d skipped: ZooKeeper unreachable; it frees when the session ends",
                           claim.shard)
            return
        tx = self._client.transaction()
        tx.check(self._path("offsets", claim.shard), claim.version)
        tx.delete(self._path("claims", claim.shard))
        try:
            results = tx.commit_async().get(timeout=_CALL_TIMEOUT)
        except (KazooException, KazooTimeoutError) as exc:
            logger.warning("release of shard %d failed (%s); it frees when the session ends", claim.shard, exc)
            return
        if any(isinstance(r, Exception) for r in results):
            logger.warning("release of shard %d refused: %s", claim.shard, results)
