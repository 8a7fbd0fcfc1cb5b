"""The row a node keeps a consumer's offsets in (logstore.offsets), apart from any backend."""

from __future__ import annotations

import msgpack
import pytest

from logstore import StorageError
from logstore.offsets import ConsumerOffsets


def test_owners_and_docs_no_shard_refers_to_are_dropped_from_the_row() -> None:
    # Every process of an app claims under a new owner name: the row must not grow with each restart.
    value = b""
    for restart in range(50):
        offsets = ConsumerOffsets.decode(value, "billing")
        offsets.claim(f"worker-{restart}", range(8))
        assert offsets.commit(f"worker-{restart}", {s: (restart, f'{{"r":{restart}}}') for s in range(8)}) == set()
        value = offsets.encode()
    _version, owners, docs, *_ = msgpack.unpackb(value)
    assert (owners, docs) == (["worker-49"], ['{"r":49}'])
    assert [(r.shard, r.location, r.owner, r.doc) for r in ConsumerOffsets.decode(value, "billing").records()] == [
        (s, 49, "worker-49", {"r": 49}) for s in range(8)]


def test_a_row_that_cannot_be_read_is_a_storage_error_naming_the_consumer() -> None:
    with pytest.raises(StorageError, match="offsets of billing on node a"):
        ConsumerOffsets.decode(b"\xc1", "billing on node a")
    with pytest.raises(StorageError, match="unknown layout"):
        ConsumerOffsets.decode(msgpack.packb([2, [], [], [], [], [], []]), "billing on node a")
