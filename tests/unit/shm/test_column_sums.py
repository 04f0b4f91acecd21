"""``shm.column_sums.ColumnSums``: per-engine sums of the work counters, reading only the slots in use."""

from __future__ import annotations

import mmap
import random
import struct

from narwhal.shm.column_sums import ColumnSums
from narwhal.shm.layout import store_u32

ROWS, COLUMNS, OFFSET = 512, 3, 64


def _table() -> mmap.mmap:
    mm = mmap.mmap(-1, OFFSET + ROWS * COLUMNS * 4 + 64)
    mm[OFFSET + ROWS * COLUMNS * 4 :] = b"\xff" * 64  # past the table: never read
    return mm


def _set(mm: mmap.mmap, row: int, column: int, value: int) -> None:
    store_u32(mm, OFFSET + (row * COLUMNS + column) * 4, value)


def _whole(mm: mmap.mmap, wanted: int) -> list[int]:
    values = struct.unpack_from(f"<{ROWS * COLUMNS}I", mm, OFFSET)
    return [sum(values[c::COLUMNS]) for c in range(wanted)]


def test_an_empty_table_sums_to_zero_reading_no_row() -> None:
    sums = ColumnSums(_table(), OFFSET, ROWS, COLUMNS, 2)
    assert sums.sums() == [0, 0]
    assert sums.rows_in_use() == 0


def test_sums_are_the_whole_tables_as_rows_fill_and_empty() -> None:
    mm = _table()
    sums = ColumnSums(mm, OFFSET, ROWS, COLUMNS, COLUMNS)
    _set(mm, 0, 1, 500)
    assert sums.sums() == [0, 500, 0] and sums.rows_in_use() == 1
    _set(mm, 1, 0, 7)
    _set(mm, 1, 2, 9)
    assert sums.sums() == [7, 500, 9] and sums.rows_in_use() == 2
    _set(mm, 300, 2, 1)  # a slot far up (many reloads): found, not assumed away
    assert sums.sums() == [7, 500, 10] and sums.rows_in_use() == 301
    _set(mm, 300, 2, 0)
    _set(mm, 1, 0, 0)
    assert sums.sums() == [0, 500, 9]
    assert sums.rows_in_use() == 301  # a high-water mark: rows that went back to 0 still summed


def test_random_tables_sum_as_a_whole_read_does() -> None:
    rng = random.Random(24)
    mm = _table()
    sums = ColumnSums(mm, OFFSET, ROWS, COLUMNS, 2)  # only the first two columns wanted
    for _ in range(200):
        row = min(int(rng.expovariate(0.2)), ROWS - 1)
        _set(mm, row, rng.randrange(COLUMNS), rng.choice([0, 0, rng.randrange(1, 2**32)]))
        assert sums.sums() == _whole(mm, 2)
    _set(mm, ROWS - 1, 0, 3)  # the last row
    assert sums.sums() == _whole(mm, 2) and sums.rows_in_use() == ROWS


def test_one_byte_set_at_the_tables_very_end_is_seen_past_the_mark() -> None:
    mm = _table()
    sums = ColumnSums(mm, OFFSET, ROWS, COLUMNS, COLUMNS)
    _set(mm, 0, 0, 1)
    assert sums.sums() == [1, 0, 0] and sums.rows_in_use() == 1
    _set(mm, ROWS - 1, COLUMNS - 1, 1 << 24)  # only the table's last byte is not zero
    assert sums.sums() == [1, 0, 1 << 24] and sums.rows_in_use() == ROWS
