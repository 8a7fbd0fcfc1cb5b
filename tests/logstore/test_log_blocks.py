"""The log block's bytes: what encode writes, decode reads back, and what is not a block is named."""

from __future__ import annotations

import datetime as dt

import pytest

from logstore.errors import CorruptBlockError
from logstore.log_blocks import BlockCell, created_from_micros, created_text, created_time, decode, encode

CELLS = [BlockCell(1, "2026-11-27 09:00:00.000001", 0, "BASE", bytes(range(16)), b"\x01,\x00body"),
         BlockCell(9, "2026-11-27 09:00:00.500000", 2**63 - 1, "_dead", b"k" * 16, b"")]


def test_a_block_reads_back_as_written() -> None:
    data = encode(CELLS)
    assert data.startswith(b"1,2026-11-27 09:00:00.000001,0,BASE,7,")
    assert decode(data) == CELLS
    assert decode(b"") == []


@pytest.mark.parametrize(("cut", "problem"), [
    (lambda d: d[:-3], "runs past the block's end"),
    (lambda d: d + b"x", "no cell starts at byte"),
    (lambda d: d.replace(b"BASE", b"BA-E"), "no cell starts at byte 0"),
    (lambda d: d.replace(b",7,", b",9,", 1), "no cell starts at byte"),
])
def test_bytes_that_are_not_a_block_are_named(cut: object, problem: str) -> None:
    with pytest.raises(CorruptBlockError, match=problem):
        decode(cut(encode(CELLS)))  # type: ignore[operator]


def test_creation_times_sort_as_text_as_they_do_as_times() -> None:
    when = dt.datetime(2026, 11, 27, 10, 0, 0, 5, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert created_text(when) == "2026-11-27 08:00:00.000005"
    assert created_time(created_text(when)) == when
    assert created_from_micros(1) == "1970-01-01 00:00:00.000001"
    assert created_text(when) < created_text(when + dt.timedelta(microseconds=1))
