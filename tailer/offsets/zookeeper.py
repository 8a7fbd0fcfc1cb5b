"""Offsets kept in ZooKeeper: distributed tailers and apps coordinated through ZooKeeper, one znode a shard
under ``/cellstream/tailers/NAME/offsets``. A reset is refused while workers are registered (their ephemeral
znodes are the list of running processes): their claims hold the shards, and a worker would find its next
commit refused. Stopped, the offsets are rewritten with each znode's version checked, so a worker that starts
meanwhile and commits first makes the reset fail rather than be overwritten."""

from __future__ import annotations

import json
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoAuthError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from pydantic import SecretStr

from logstore import Store
from tailer.coordinators.zookeeper import refused, tailer_path, translate, zookeeper_client
from tailer.errors import ConsumerNotFoundError, ConsumerRunningError, CoordinationError
from tailer.offsets.history import new_reset_id
from tailer.offsets.places import ConsumerPositions, ResetPlan, ShardOffsetsPlace, shard_rows

_BATCH = 200  # znodes a transaction, as the coordinator commits them


class ZooKeeperOffsets(ShardOffsetsPlace):
    """The tailers (and apps) coordinated through the ZooKeeper at ``zookeeper`` (``host:port[/chroot]``)."""

    kind = "zookeeper"

    def __init__(self, store: Store, zookeeper: str, *, timeout: float = 10.0, auth: SecretStr | None = None) -> None:
        self.store = store
        self.zookeeper = zookeeper
        self.where = f"zookeeper {zookeeper}"
        self.timeout = timeout
        self.auth = auth
        self.hosts, root = tailer_path(zookeeper, "x")
        self.base = root.rsplit("/", 1)[0]

    def _client(self) -> KazooClient:
        client = zookeeper_client(self.hosts, self.timeout, self.auth)
        try:
            client.start(timeout=self.timeout)
        except KazooTimeoutError:
            client.close()
            raise translate(TimeoutError(f"no answer from {self.hosts} in {self.timeout:g}s"), "connect") from None
        return client

    def _run(self, what: str, fn: Any) -> Any:
        client = self._client()
        try:
            return fn(client)
        except NoAuthError as exc:
            raise refused(exc, self.base, self.auth) from None
        except (KazooException, KazooTimeoutError) as exc:
            raise translate(exc, what) from None
        finally:
            client.stop()
            client.close()

    def consumers(self) -> list[str]:
        def run(client: KazooClient) -> list[str]:
            if client.exists(self.base) is None:
                return []
            return sorted(name for name in client.get_children(self.base)
                          if client.exists(f"{self.base}/{name}/offsets") is not None)
        return list(self._run("list of consumers", run))

    def _read(self, client: KazooClient, name: str
              ) -> tuple[dict[int, tuple[dict[str, Any], int]], list[str], dict[int, int]]:
        """(offset doc and znode version by shard, the running workers, how far they have had cells
        acknowledged past their commits: their registrations' ``published``)."""
        root = f"{self.base}/{name}"
        if client.exists(f"{root}/offsets") is None:
            raise ConsumerNotFoundError(f"no consumer named {name!r} in ZooKeeper at {self.zookeeper}")
        offsets: dict[int, tuple[dict[str, Any], int]] = {}
        children = client.get_children(f"{root}/offsets")
        answers = [(child, client.get_async(f"{root}/offsets/{child}")) for child in children]
        for child, answer in answers:
            try:
                raw, stat = answer.get(timeout=self.timeout)
            except NoNodeError:
                continue
            offsets[int(child)] = (json.loads(raw) if raw else {}, stat.version)
        holders: list[str] = []
        published: dict[int, int] = {}
        for member in sorted(client.get_children(f"{root}/workers") if client.exists(f"{root}/workers") else []):
            try:
                raw, _ = client.get(f"{root}/workers/{member}")
            except NoNodeError:
                continue
            info = json.loads(raw) if raw else {}
            published.update((int(shard), int(at)) for shard, at in info.get("published", {}).items())
            holders.append(f"{info.get('worker', member)} (pid {info.get('pid', '?')} on {info.get('host', '?')})")
        return offsets, holders, published

    def positions(self, name: str) -> ConsumerPositions:
        offsets, holders, published = self._run("read of offsets", lambda client: self._read(client, name))
        columns = next((doc["columns"] for doc, _version in offsets.values() if "columns" in doc), None)
        rows = shard_rows(self.store, {
            shard: (doc.get("location"), str(doc["owner"]).rsplit("/", 1)[-1] if doc.get("owner") else None,
                    published.get(shard)) for shard, (doc, _version) in offsets.items()}, columns)
        return ConsumerPositions(name, self.kind, self.where, rows, holders)

    def execute(self, plan: ResetPlan) -> ResetPlan:
        reset_id = new_reset_id()

        def run(client: KazooClient) -> None:
            offsets, holders, _published = self._read(client, plan.name)
            if holders:
                raise ConsumerRunningError(
                    f"{plan.name} has {len(holders)} running workers ({', '.join(holders)}): stop them, then "
                    "reset its offsets", holders)
            root = f"{self.base}/{plan.name}/offsets"
            changes = [(int(key), after) for key, _before, after in plan.changes]
            for start in range(0, len(changes), _BATCH):
                tx = client.transaction()
                for shard, location in changes[start:start + _BATCH]:
                    doc, version = offsets.get(shard, ({}, -1))
                    new = json.dumps({**doc, "location": location, "owner": None, "token": reset_id,
                                      "reset": reset_id}, separators=(",", ":"), sort_keys=True).encode()
                    if version < 0:
                        tx.create(f"{root}/{shard}", new)
                    else:
                        tx.set_data(f"{root}/{shard}", new, version=version)
                results = tx.commit()
                failed = [r for r in results if isinstance(r, Exception)]
                if failed:
                    raise CoordinationError(f"{plan.name}: a worker committed during reset {reset_id} ({failed[0]!r});"
                                            f" {start} of {len(changes)} positions were reset: run it again")
        self._run("reset of offsets", run)
        plan.reset_id = reset_id
        return plan
