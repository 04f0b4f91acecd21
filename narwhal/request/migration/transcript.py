"""The transcript of a stream that may migrate: the spans its client was sent, kept unread.

A cut asks what the client saw (``seen``); until then nothing asks, and most streams end
without a cut. So the spans are kept as they went out — references, no parsing, the relay's
rule of no JSON work per chunk — and read only when a cut asks.

Why compress instead of reading a long stream's spans as they pile up: reading is an
``orjson.loads`` and a dozen dict lookups per event, which made a 128-token paced stream's
transcript half of the worker's Python calls for the request (``python -m perf.callcount
--cases paced_long_c128``). Most of a span's bytes are the SSE and JSON framing that repeats in
every event, so once :data:`COMPACT_AT_BYTES` are kept they go into one ``zlib`` block (level 1,
one C call per block, many times smaller): the memory a long stream holds stays near what
reading kept (its text as a list of strings), at a fraction of the CPU (perf/RESULTS.md "Paced
streams beside vllm-router"). A cut decompresses and reads every block once.

Invariant: spans are kept in the order they were sent, each once; :meth:`Transcript.read`
hands every one of them to the reader exactly once, in that order.
"""

from __future__ import annotations

import zlib

from narwhal.request.migration.seen import Seen

COMPACT_AT_BYTES = 16 * 1024
"""Spans kept raw up to this many bytes; past it they go into one compressed block."""

_LEVEL = 1  # zlib's fastest: the framing compresses well at any level, and this runs per block


class Transcript:
    """What a stream's client was sent: recent spans raw, older ones in compressed blocks."""

    __slots__ = ("spans", "size", "_blocks")

    def __init__(self) -> None:
        self.spans: list[bytes] = []  # sent, not compacted yet (appended by the client's sink)
        self.size = 0  # bytes in ``spans``
        self._blocks: list[bytes] = []  # older spans, joined and compressed, in order

    def keep(self, span: bytes) -> None:
        """Keep a span the client was just sent (every one, in order)."""
        self.spans.append(span)
        self.size += len(span)
        if self.size > COMPACT_AT_BYTES:
            self._blocks.append(zlib.compress(b"".join(self.spans), _LEVEL))
            self.spans, self.size = [], 0

    def read(self, seen: Seen) -> Seen:
        """Hand every span kept since the last read to ``seen``, in order; return it."""
        for block in self._blocks:  # one at a time: a long stream is never whole in memory
            seen.absorb([zlib.decompress(block)])
        self._blocks = []
        if self.spans:
            seen.absorb(self.spans)
            self.spans, self.size = [], 0
        return seen
