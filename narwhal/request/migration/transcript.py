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

The last :data:`TAIL_SPANS` spans always stay raw (:meth:`Transcript.tail`): whether the stream's
finish already went out is read from them alone, before a continuation is decided, so a storm of
cuts reads a few events per stream, not every stream's whole output.

Bounded: a transcript holds at most :data:`MAX_KEPT_BYTES` of compacted blocks, and each block
is held against the worker's stream-buffer budget (``request.stream_buffers``), given back when
the stream ends (:meth:`Transcript.close`). Past either, it stops keeping (:attr:`full`): its
stream is not continued after a cut (a ``logprobs`` stream of 32k tokens kept ~19 MB), and only
the last spans stay, for the finish probe.

Invariant: spans are kept in the order they were sent, each once; :meth:`Transcript.read`
hands every one of them to the reader exactly once, in that order; a :attr:`full` transcript is
never read.
"""

from __future__ import annotations

import zlib

from narwhal.request.migration.seen import Seen
from narwhal.request.stream_buffers import StreamBuffers

COMPACT_AT_BYTES = 16 * 1024
"""Spans kept raw up to this many bytes; past it they go into one compressed block."""

MAX_KEPT_BYTES = 4 * 1024 * 1024
"""Compacted bytes one transcript may hold; past them it stops keeping (the module's text)."""

TAIL_SPANS = 2
"""Spans kept raw after a compaction: a stream's finish and its usage chunk are in the last two."""

_LEVEL = 1  # zlib's fastest: the framing compresses well at any level, and this runs per block


class Transcript:
    """What a stream's client was sent: recent spans raw, older ones in compressed blocks."""

    __slots__ = ("spans", "size", "_blocks", "held", "_buffers", "full")

    def __init__(self, buffers: StreamBuffers | None = None) -> None:
        self.spans: list[bytes] = []  # sent, not compacted yet (appended by the client's sink)
        self.size = 0  # bytes in ``spans``
        self._blocks: list[bytes] = []  # older spans, joined and compressed, in order
        self.held = 0  # compacted bytes held (against ``_buffers``, when given): :meth:`close` gives them back
        self._buffers = buffers  # the worker's stream-buffer budget
        self.full = False  # stopped keeping: past its bound, or the worker's budget

    def keep(self, span: bytes) -> None:
        """Keep a span the client was just sent (every one, in order)."""
        self.spans.append(span)
        self.size += len(span)
        if self.size > COMPACT_AT_BYTES and len(self.spans) > TAIL_SPANS:
            spans = self.spans
            if not self.full:
                self._compact(zlib.compress(b"".join(spans[:-TAIL_SPANS]), _LEVEL))
            self.spans = spans = spans[-TAIL_SPANS:]
            self.size = sum(map(len, spans))

    def _compact(self, block: bytes) -> None:
        held = self.held + len(block)
        if held > MAX_KEPT_BYTES or (self._buffers is not None and not self._buffers.hold(len(block))):
            self.full = True  # from here only the tail is kept; what was held is given back
            self._blocks = []
            self._release()
            return
        self._blocks.append(block)
        self.held = held

    def _release(self) -> None:
        if self._buffers is not None and self.held:
            self._buffers.free(self.held)
        self.held = 0

    def close(self) -> None:
        """The stream ended: what it held is given back (idempotent)."""
        self._blocks = []
        self._release()

    def tail(self) -> list[bytes]:
        """The last spans sent (up to :data:`TAIL_SPANS`), raw, in order; nothing is consumed."""
        return self.spans[-TAIL_SPANS:]

    def read(self, seen: Seen) -> Seen:
        """Hand every span kept since the last read to ``seen``, in order; return it."""
        assert not self.full, "a full transcript is never read"
        for block in self._blocks:  # one at a time: a long stream is never whole in memory
            seen.absorb([zlib.decompress(block)])
        self._blocks = []
        self._release()
        if self.spans:
            seen.absorb(self.spans)
            self.spans, self.size = [], 0
        return seen
