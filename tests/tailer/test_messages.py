"""A message's value read back as the cell it carries: every value the standard library's JSON reads, whichever
decoder reads it."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import msgpack
import pytest

from logstore.cell import Cell
from tailer.messages import decode_cell, decode_cell_value, encode_cell


def test_a_cell_comes_back_as_sent() -> None:
    cell = Cell(uuid.uuid4(), "BASE", 3, {"fare": 12.5, "city": "sf", "n": -(2**63), "tags": ["é", None]}, 17, 5,
                dt.datetime(2026, 11, 27, 9, 30, 1, 123456, tzinfo=dt.UTC))
    message = encode_cell(cell)
    assert decode_cell(message.value, message.headers) == cell
    assert decode_cell(encode_cell(cell, "msgpack").value, encode_cell(cell, "msgpack").headers) == cell


def test_what_the_fast_decoder_refuses_is_read_as_json_reads_it() -> None:
    """An integer over 64 bits and a lone surrogate escape: JSON that orjson refuses and json accepts."""
    record = {"row_key": str(uuid.uuid4()), "column": "BASE", "ref_key": 1, "added_id": 2, "shard": 0,
              "created_at": "2026-11-27T09:30:00+00:00", "body": {"big": 2**70, "odd": "\ud800"}}
    value = json.dumps(record).encode()
    assert decode_cell(value).body == {"big": 2**70, "odd": "\ud800"}


def test_a_value_read_without_its_headers_tells_its_format_by_its_first_byte() -> None:
    """What a Kafka-mode app reads: the same cell from either format, with no header; a value that is no cell
    raises (the app dead-letters it), whichever format it looks like."""
    cell = Cell(uuid.uuid4(), "BASE", 3, {"fare": 12.5, "when": [1, 2]}, 17, 5,
                dt.datetime(2026, 11, 27, 9, 30, 1, tzinfo=dt.UTC))
    for value_format in ("json", "msgpack"):
        message = encode_cell(cell, value_format)
        assert decode_cell_value(message.value) == cell == decode_cell(message.value, message.headers)
    for value in (b"", b"[1, 2]", b"{}", msgpack.packb(123), msgpack.packb({"row_key": "not a uuid"}), b"{not json"):
        with pytest.raises((KeyError, TypeError, ValueError)):
            decode_cell_value(value)
