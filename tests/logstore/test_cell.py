"""The stored body format and the shard hash: stable, documented, uniform."""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import struct
import time
import uuid
import zlib

import msgpack
import pytest

from logstore.cell import Cell, PackedCell, compress, decode_body, pack_body, same_json, shard_of, unpack_body
from logstore.errors import CorruptCellError


def test_shard_hash_matches_the_documented_vectors() -> None:
    # blake2b(row_key.bytes, digest_size=8) as a big-endian integer, mod the shard count.
    key = uuid.UUID(int=0)
    digest = __import__("hashlib").blake2b(key.bytes, digest_size=8).digest()
    assert shard_of(key, 4096) == int.from_bytes(digest, "big") % 4096 == 1038
    assert shard_of(uuid.UUID("5eed0000-0000-0000-0000-000000000001"), 4096) == 421
    assert shard_of(uuid.UUID("123e4567-e89b-12d3-a456-426614174000"), 4096) == 2653
    assert shard_of(uuid.UUID("123e4567-e89b-12d3-a456-426614174000"), 16) == 2653 % 16


def _uuid7(ms: int, counter: int) -> uuid.UUID:
    raw = bytearray(struct.pack(">Q", ms << 16)[:6] + counter.to_bytes(10, "big"))
    raw[6] = (raw[6] & 0x0F) | 0x70
    raw[8] = (raw[8] & 0x3F) | 0x80
    return uuid.UUID(bytes=bytes(raw))


@pytest.mark.parametrize("kind", ["uuid4", "uuid7", "uuid1"])
def test_shard_hash_is_uniform_for_random_and_time_ordered_keys(kind: str) -> None:
    shards, n = 64, 64 * 400
    start = int(time.time() * 1000)
    make = {
        "uuid4": lambda i: uuid.uuid4(),
        "uuid7": lambda i: _uuid7(start + i // 8, i),
        "uuid1": lambda i: uuid.uuid1(node=0x010203040506, clock_seq=i % 16384),
    }[kind]
    counts = collections.Counter(shard_of(make(i), shards) for i in range(n))
    expected = n / shards
    chi2 = sum((counts.get(s, 0) - expected) ** 2 / expected for s in range(shards))
    assert len(counts) == shards
    assert chi2 < 120, f"chi-square {chi2:.1f} with 63 degrees of freedom: not uniform"  # p < 1e-5


def test_body_format_is_a_version_byte_and_zlib_messagepack() -> None:
    body = {"a": [1, 2.5, None, True], "s": "x" * 100}
    blob = compress(pack_body(body, 1 << 20), 6)
    assert blob[0] == 1
    assert msgpack.unpackb(zlib.decompress(blob[1:])) == body
    assert decode_body(blob) == body


@pytest.mark.parametrize("blob", [b"", b"\x02abc", b"\x01not zlib", b"\x01" + zlib.compress(b"\x93\x01\x02\x03")])
def test_undecodable_bodies_are_typed_errors(blob: bytes) -> None:
    with pytest.raises(CorruptCellError):
        decode_body(blob)


def test_same_json_tells_json_types_apart() -> None:
    assert same_json({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]})
    assert not same_json({"a": 1}, {"a": 1.0})
    assert not same_json({"a": 1}, {"a": True})
    assert not same_json({"a": [1]}, {"a": [1, 2]})
    assert not same_json({"a": 1}, {"b": 1})


def test_random_bodies_round_trip() -> None:
    rng = __import__("random").Random(int.from_bytes(os.urandom(4), "big"))

    def value(depth: int) -> object:
        kind = rng.randrange(8 if depth < 4 else 5)
        return [
            lambda: rng.randint(-(2**63), 2**64 - 1), lambda: rng.uniform(-1e9, 1e9),
            lambda: "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(8))),
            lambda: rng.random() < 0.5, lambda: None,
            lambda: [value(depth + 1) for _ in range(rng.randrange(4))],
            lambda: {f"k{i}": value(depth + 1) for i in range(rng.randrange(4))},
            lambda: {"nested": {"list": [value(depth + 1)]}},
        ][kind]()

    for _ in range(300):
        body = {f"f{i}": value(0) for i in range(rng.randrange(6))}
        assert same_json(decode_body(compress(pack_body(body, 1 << 20), 1)), body)


def test_a_cell_packed_or_not_names_itself_by_the_same_coordinates() -> None:
    row_key = uuid.UUID("123e4567-e89b-12d3-a456-426614174000")
    created = dt.datetime(2026, 11, 25, 14, 30, 5, 250_000, tzinfo=dt.UTC)
    cell = Cell(row_key, "BASE", 7, {"fare": 12.5}, 42, 2653, created)
    packed = PackedCell(row_key, "BASE", 7, msgpack.packb({"fare": 12.5}), 42, 2653, created)

    assert cell.coordinates() == packed.coordinates() == {
        "row_key": "123e4567-e89b-12d3-a456-426614174000", "column": "BASE", "ref_key": 7, "added_id": 42,
        "shard": 2653, "created_at": "2026-11-25T14:30:05.250000+00:00"}
    assert cell.to_json() == {**cell.coordinates(), "body": {"fare": 12.5}}
    assert list(cell.to_json()) == ["row_key", "column", "ref_key", "added_id", "shard", "created_at", "body"]


# -- reading trusts nothing stored: an inflate cap, and JSON types only ------------------------
def _blob(packed: bytes, level: int = 9) -> bytes:
    return b"\x01" + zlib.compress(packed, level)


def _nested(depth: int) -> dict[str, object]:
    body: dict[str, object] = {}
    inner = body
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]  # type: ignore[assignment]
    return body


@pytest.mark.parametrize("size", [64 * 1024, 8 * 1024 * 1024])  # inflated in one call, and by decompressobj
def test_a_body_inflates_no_further_than_its_cap(size: int) -> None:
    packed = msgpack.packb({"s": "a" * size})
    cap = len(packed)
    assert decode_body(_blob(packed), cap) == {"s": "a" * size}
    assert unpack_body(_blob(packed), cap) == packed
    for read in (decode_body, unpack_body):
        with pytest.raises(CorruptCellError, match=f"inflates past {cap - 1} bytes"):
            read(_blob(packed), cap - 1)


def test_a_zlib_bomb_is_a_corrupt_cell_at_the_default_cap() -> None:
    bomb = _blob(msgpack.packb({"s": "a" * (64 * 1024 * 1024)}))  # 64 MiB from about 64 KB
    assert len(bomb) < 100_000
    for read in (decode_body, unpack_body):
        with pytest.raises(CorruptCellError, match="inflates past 4194304 bytes"):
            read(bomb)


def test_a_truncated_stream_is_refused_on_the_capped_path_too() -> None:
    packed = msgpack.packb({"s": os.urandom(3000).hex()})
    cut = _blob(packed)[:-10]
    for cap in (len(packed), 1 << 30):  # capped (decompressobj) and uncapped (one call)
        with pytest.raises(CorruptCellError, match="incomplete or truncated"):
            decode_body(cut, len(packed) if cap == len(packed) else cap)


# MessagePack a JSON encoder cannot write: each made a worker node's page answer 500 before it was refused here.
NOT_JSON = {
    "bin": msgpack.packb({"a": b"xy"}, use_bin_type=True),
    "empty bin": msgpack.packb({"a": [1, b""]}, use_bin_type=True),
    "bin key": msgpack.packb({"ok": 1, b"k": 1}, use_bin_type=True),
    "empty bin key": msgpack.packb({b"": 1}, use_bin_type=True),
    "ext": msgpack.packb({"a": msgpack.ExtType(5, b"xy")}),
    "empty ext": b"\x81\xa1a\xc7\x00\x05",
    "timestamp": msgpack.packb({"a": msgpack.Timestamp(1, 0)}),
    "NaN": msgpack.packb({"a": None, "b": float("nan")}),
    "infinity": msgpack.packb({"a": [float("-inf")]}),
    "float 32 NaN": b"\x81\xa1a\xca\x7f\xc0\x00\x00",
    "nested 1000 deep": msgpack.packb(_nested(1000)),
}
# Never written either (deeper than MAX_DEPTH, a key not a string), though json.dumps would take them.
ALSO_REFUSED = {"nested 300 deep": msgpack.packb(_nested(300)), "integer key": b"\x81\x01\x01"}


@pytest.mark.parametrize("packed", [*NOT_JSON.values(), *ALSO_REFUSED.values()], ids=[*NOT_JSON, *ALSO_REFUSED])
def test_a_body_of_what_json_cannot_hold_is_a_corrupt_cell(packed: bytes) -> None:
    if packed in NOT_JSON.values():  # a poison for the worker node's answers, not only an oddity
        with pytest.raises((TypeError, ValueError, RecursionError)):
            json.dumps(msgpack.unpackb(packed, raw=False, strict_map_key=False), allow_nan=False)
    with pytest.raises(CorruptCellError, match=r"not JSON|not a JSON type|not allowed for map key"):
        decode_body(_blob(packed))
    with pytest.raises(CorruptCellError):
        PackedCell(uuid.uuid4(), "BASE", 1, packed, 1, 0, dt.datetime.now(dt.UTC)).body  # noqa: B018


def test_the_path_to_what_is_not_json_is_quoted() -> None:
    with pytest.raises(CorruptCellError) as caught:
        decode_body(_blob(msgpack.packb({"x\ny": [0, b""]}, use_bin_type=True)))
    assert "\n" not in str(caught.value) and "'body.x\\ny[1]'" in str(caught.value)


@pytest.mark.parametrize("body", [
    {"a": None, "f": 1e308, "g": -1.7e308, "s": "null NaN \xca\x7f", "n": [None, 0.0, -0.0, 1.5, 2**64 - 1]},
    {"deep": _nested(60), "none": None, "big": 1.7976931348623157e308},
    {"text": "żółć ∑ 日本語 " * 40, "k" * 200: [True, False, None]},
], ids=["nulls beside huge floats", "deep and null", "text"])
def test_json_bodies_that_look_like_the_refused_ones_still_decode(body: dict[str, object]) -> None:
    assert decode_body(compress(pack_body(body, 1 << 20), 6)) == body
