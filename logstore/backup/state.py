"""What a backup takes besides the cells (its state file): the nodes and shard map, every consumer's offsets,
and the index versions with their positions. No password is ever in it: node URLs are written without theirs.

It is read *before* the watermarks: every offset and index position then names a cell at or below its shard's
watermark (a consumer commits only ids it has read, and those were committed before the heads were read), so
a restore of the whole backup keeps them as they are.
"""

from __future__ import annotations

import json
from typing import Any

from logstore.index_tables.persistence import IndexSpec
from logstore.registry import without_password
from logstore.store import Store

STATE_VERSION = 1


def _scrubbed(value: Any) -> Any:
    """``value`` (the shard map's JSON) with every URL's password taken out, wherever it is."""
    if isinstance(value, dict):
        return {k: _scrubbed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrubbed(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return without_password(value)
    return value


def collect_state(store: Store) -> dict[str, Any]:
    """The state file's value: ``nodes`` (each node's recorded metadata: shard count, first and last shard of
    its home range), ``shard_map`` (the map's JSON, passwords out), ``placement`` (each shard's node),
    ``consumers`` (name -> [shard, location, owner, doc JSON] per shard) and ``indexes`` (the storage
    JSON of each version, and its ``live`` and ``backfill`` positions as [shard, location, target])."""
    consumers: dict[str, list[list[Any]]] = {}
    store.check_direct("a backup")
    for name in store.consumers():
        consumers[name] = [[r.shard, r.location, r.owner, json.dumps(r.doc, sort_keys=True)]
                           for _, r in sorted(store.read_offsets(name).items())]
    indexes: list[dict[str, Any]] = []
    for spec in store.indexes.specs():
        indexes.append({"spec": spec.storage_json(), "positions": {
            stream: [[p.shard, p.location, p.target] for _, p in sorted(store.indexes.positions(spec, stream).items())]
            for stream in ("live", "backfill")}})
    nodes: dict[str, list[int] | None] = {}
    for name in store.nodes:
        recorder = store.node_recorder(name)
        meta = recorder.read_meta() if recorder is not None else None
        nodes[name] = None if meta is None else [meta.shard_count, meta.first, meta.last]
    return {"version": STATE_VERSION, "shard_count": store.shard_count, "nodes": nodes,
            "shard_map": _scrubbed(json.loads(store.shard_map.to_json())), "placement": store.placement(),
            "consumers": consumers, "indexes": indexes}


def index_specs(state: dict[str, Any]) -> list[IndexSpec]:
    """The index versions of a state file's value."""
    return [IndexSpec.model_validate_json(entry["spec"]) for entry in state.get("indexes", [])]
