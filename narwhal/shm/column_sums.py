"""Column sums of a table of u32 counters in shared memory, reading only the rows in use.

The holdings region keeps one row of counters per worker slot (512 of them, ``layout.WORKER_SLOTS``)
and one column per engine; placement needs each column's sum on every request. Slots are
taken lowest first, so all rows past the last busy worker's are zero: summing them cost a
512-row unpack per request for nothing.

Invariants, and why:

* Exact: rows past ``rows_in_use`` are all zero bytes, checked on every read, not assumed; a
  zero row adds nothing, so the sums are the whole table's.
* Cheap: the bound is a high-water mark, checked with one search of the shared bytes for the
  tail's length of zeros from the mark (``mmap.find``: nothing copied, where a comparison of a
  slice copied the tail and its zeros on every read); only a counter set past it searches
  again (a binary search over "the tail from row r is zero", true from some r on). It never
  shrinks: a worker with nothing in flight has a zero row, and searching each time it flickers
  would cost more than summing it.
* Reads only; a counter being stored meanwhile is read before or after its store, as with a
  whole-table read (each is one aligned four-byte copy, ``layout.store_u32``).
"""

from __future__ import annotations

import mmap
import struct


class ColumnSums:
    """Per column, the sum over every row of a ``rows`` × ``columns`` table of little-endian u32
    at ``offset`` in ``mm``; only the first ``wanted`` columns are summed."""

    __slots__ = ("mm", "offset", "rows", "columns", "wanted", "_row_bytes", "_zeros", "_end", "_in_use", "_tail_at",
                 "_tail", "_structs")

    def __init__(self, mm: mmap.mmap, offset: int, rows: int, columns: int, wanted: int) -> None:
        self.mm = mm
        self.offset = offset
        self.rows = rows
        self.columns = columns
        self.wanted = min(wanted, columns)
        self._row_bytes = columns * 4
        self._zeros = bytes(rows * columns * 4)
        self._end = offset + rows * columns * 4
        self._in_use = 0
        self._tail_at = offset  # where the rows past the mark start, and as many zero bytes
        self._tail = memoryview(self._zeros)
        self._structs: dict[int, struct.Struct] = {}

    def _zero_from(self, row: int) -> bool:
        """Every counter of rows ``row`` … ``rows - 1`` is 0."""
        start = self.offset + row * self._row_bytes
        return self.mm[start : self._end] == self._zeros[: self._end - start]

    def rows_in_use(self) -> int:
        """A number of leading rows past which every counter is 0: the highest it has been."""
        found, at = self._in_use, self._tail_at
        if self.mm.find(self._tail, at, self._end) == at:  # the one place it fits: the tail is zero
            return found
        low, high = found + 1, self.rows  # the smallest row from which the tail is zero
        while low < high:
            middle = (low + high) // 2
            if self._zero_from(middle):
                high = middle
            else:
                low = middle + 1
        self._in_use = low
        self._tail_at = at = self.offset + low * self._row_bytes
        self._tail = memoryview(self._zeros)[: self._end - at]
        return low

    def sums(self) -> list[int]:
        """Per wanted column, the sum of its counters over every row."""
        rows, width = self.rows_in_use(), self.columns
        if not rows:
            return [0] * self.wanted
        reader = self._structs.get(rows)
        if reader is None:
            reader = self._structs[rows] = struct.Struct(f"<{rows * width}I")
        values = reader.unpack_from(self.mm, self.offset)
        if rows == 1:
            return list(values[: self.wanted])
        return [sum(values[column::width]) for column in range(self.wanted)]
