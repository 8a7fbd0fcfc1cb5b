"""What ``cellstream tail status NAME`` shows: workers, leader, owners, offsets and lag per shard, and the
tailer's re-publish jobs (:func:`republish_jobs`)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from logstore import CorruptCellError, Store
from logstore.extras import require
from tailer.coordinators.local import read_offsets
from tailer.errors import ConfigurationError
from tailer.republish import republish_jobs as republish_jobs  # the re-publish jobs `tail status` lists


def _shard_rows(store: Store, offsets: dict[int, dict[str, Any]], owners: dict[int, str | None],
                claims: dict[int, str | None], published: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Each shard's row; its lag counted from what its worker has had acknowledged (``published``, reported
    by running workers) when that is past the commit, so a tailer between two commits is not shown behind."""
    rows = []
    published = published or {}
    for shard in range(store.shard_count):
        doc = offsets.get(shard, {})
        location = doc.get("location")
        delivered = max(int(location or 0), published.get(shard, 0))
        behind, seconds = lag_of(store, shard, delivered)
        rows.append({
            "shard": shard, "assigned_to": owners.get(shard), "claimed_by": claims.get(shard),
            "location": location, "published": published.get(shard, location), "head": store.head(shard),
            "lag_cells": behind, "lag_seconds": round(seconds, 3),
            "deadlettered": int(doc.get("deadlettered", 0)), "last_error": doc.get("last_error"),
        })
    return rows


def zookeeper_status(store: Store, zookeeper: str, name: str, timeout: float = 10.0,
                     auth: SecretStr | None = None) -> dict[str, Any]:
    """The tailer's workers, assignment and offsets as read from ZooKeeper (with ``auth``, ``user:password``,
    when its znodes have a digest ACL)."""
    require("zookeeper", "a ZooKeeper tailer's status")
    from kazoo.exceptions import KazooException, NoAuthError, NoNodeError
    from kazoo.handlers.threading import KazooTimeoutError

    from tailer.coordinators.zookeeper import refused, tailer_path, translate, zookeeper_client

    hosts, root = tailer_path(zookeeper, name)
    client = zookeeper_client(hosts, timeout, auth)
    try:
        client.start(timeout=timeout)
    except KazooTimeoutError:
        client.close()
        raise translate(TimeoutError(f"no answer from {hosts} in {timeout:g}s"), "connect") from None
    try:
        if client.exists(root) is None:
            raise ConfigurationError(f"no tailer named {name!r} in ZooKeeper at {zookeeper}")
        members = sorted(client.get_children(f"{root}/workers"), key=lambda m: int(m.rsplit("-", 1)[1]))
        workers = []
        published: dict[int, int] = {}
        for index, member in enumerate(members):
            try:
                raw, _ = client.get(f"{root}/workers/{member}")
            except NoNodeError:
                continue
            info = json.loads(raw)
            published.update((int(shard), int(at)) for shard, at in info.pop("published", {}).items())
            workers.append({**info, "member": member, "leader": index == 0})
        raw, _ = client.get(f"{root}/assignment")
        assignment = json.loads(raw) if raw else {}
        owners = {s: m.rsplit("/", 1)[1] for m, shards in assignment.get("workers", {}).items() for s in shards}
        offsets: dict[int, dict[str, Any]] = {}
        claims: dict[int, str | None] = {}
        for child in client.get_children(f"{root}/offsets"):
            raw, _ = client.get(f"{root}/offsets/{child}")
            offsets[int(child)] = json.loads(raw)
        for child in client.get_children(f"{root}/claims"):
            try:
                raw, _ = client.get(f"{root}/claims/{child}")
            except NoNodeError:
                continue
            claims[int(child)] = json.loads(raw)["worker"].rsplit("/", 1)[1]
    except NoAuthError as exc:
        raise refused(exc, root, auth) from None
    except (KazooException, KazooTimeoutError) as exc:
        raise translate(exc, "status read") from None
    finally:
        client.stop()
        client.close()
    return {"tailer": name, "epoch": assignment.get("epoch", 0), "workers": workers,
            "shards": _shard_rows(store, offsets, owners, claims, published)}


def standalone_status(store: Store, offsets_file: str, name: str) -> dict[str, Any]:
    path = Path(offsets_file)
    if not path.exists():
        raise ConfigurationError(f"no offsets file at {path}: the standalone tailer has not committed yet")
    offsets = {int(s): doc for s, doc in read_offsets(path).items()}
    owners: dict[int, str | None] = dict.fromkeys(range(store.shard_count), "standalone")
    from tailer.offsets.file import FileOffsets

    published = {row.shard: row.published for row in FileOffsets(store, path).positions(str(path)).rows
                 if row.shard is not None and row.published is not None}
    return {"tailer": name, "epoch": None, "workers": [{"worker": "standalone", "leader": True}],
            "shards": _shard_rows(store, offsets, owners, {}, published)}


def lag_of(store: Store, shard: int, location: int) -> tuple[int, float]:
    """(cells after ``location``, seconds since the first of them was created) of a shard."""
    behind = store.count_after(shard, location)
    if not behind:
        return 0, 0.0
    try:
        cells, _ = store.get_cells_for_shard(shard, location, 1)
        created = cells[0].created_at if cells else None
    except CorruptCellError as exc:
        created = exc.created_at
    if created is None:
        return behind, 0.0
    return behind, max(0.0, (dt.datetime.now(dt.UTC) - created).total_seconds())
