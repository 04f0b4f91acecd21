"""The decode relay after the first token: engine bytes to the client inside the data callback.

Why: once the first token is out, almost every span of SSE events only has to be passed on.
Doing that through the decode generator costs, per span, a future, a task wakeup, a chain of
coroutine frames and a client write coroutine — the largest per-token cost left in the router
(the perf suite's paced-decode scenario sends every token on its own). Here the connection's
data callback frames the bytes of each socket read (events the engine wrote as separate
chunks but that arrived together become one client write) and hands each span to a *sink*
that writes it to the client's transport; the generator sleeps until something needs it:

* a span that may end the stream (``[DONE]`` or an error object): the generator classifies it;
* a client that fell behind (the sink reports its transport above the high-water mark): the
  relay returns ``Signal.BEHIND`` and its caller waits for the client, under its write timeout;
* silence longer than ``decode_read_timeout_s``, or the deadline: ``BoundPassed``, a ``TimeoutError``;
* the engine's end or failure: the generator's ordinary read path reports it.

Per token, after the first: one read, one sink call, one framing step, one byte probe — and
each of those is as few Python calls as it can be, because this runs once per token of every
stream: the connection hands the read over without a helper, the framer's common case (whole
LF-framed events, nothing held back) returns the chunk itself after one ``endswith``, and the
OpenAI endpoints' probe is two ``in`` tests here.

Invariants: bytes reach the sink in the order received and each exactly once (chunks that
arrive while the relay is stopped wait in the connection's buffer, which pauses the socket
when full); one timer per stream, re-armed lazily, not one per span.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable
from typing import Literal

from narwhal.engines.failures import BoundPassed, leg_bound
from narwhal.engines.http1 import Connection
from narwhal.engines.sse import EventOverBudget, EventTooLarge, SSEFramer, may_end_stream

Sink = Callable[[bytes], bool]  # write a span to the client; False when the client fell behind


class Signal(enum.Enum):
    """A span read that brings no bytes for the client says which of these instead.

    Spans themselves stay plain ``bytes`` (no wrapper, no allocation per span); a read returns
    ``bytes | Signal``, and the caller tells them apart with one ``is``."""

    END = "end"  # the stream is over: its terminal event already went out (DecodeLeg.next_span)
    BEHIND = "behind"  # the client fell behind: let it drain under its write bound, then read again
    HANDBACK = "handback"  # the relay stopped with nothing held: the engine ended or failed; read to see how


class DirectRelay:
    """Hands a stream's spans to the sink from the connection's data callback until it must stop."""

    __slots__ = (
        "_conn", "_framer", "_sink", "_loop", "_read_timeout", "_deadline", "_last", "_timer",
        "_stopped", "_held", "timed_out_at", "_may_end", "spans", "_openai", "_broken",
    )

    def __init__(
        self, conn: Connection, framer: SSEFramer, sink: Sink, read_timeout: float, deadline: float | None,
        may_end: Callable[[bytes], bool] = may_end_stream, loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._conn = conn
        self._may_end = may_end  # the endpoint's byte probe for its terminal event or an error
        # The OpenAI-framed endpoints' probe is two byte searches: done here, in the callback,
        # rather than by calling it once per token (see _on_body).
        self._openai = may_end is may_end_stream
        self._framer = framer
        self._sink = sink
        self._loop = loop or asyncio.get_running_loop()
        self._read_timeout = read_timeout
        self._deadline = deadline
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = False
        self._held: bytes | None = None
        self.timed_out_at: float | None = None
        self._broken: EventTooLarge | EventOverBudget | None = None  # the engine's stream could not be framed
        self.spans = 0  # spans handed to the sink (the inter-token figure's count)

    async def run(self) -> bytes | Literal[Signal.BEHIND, Signal.HANDBACK]:
        """Relay until the generator is needed. Returns a span to classify, ``Signal.BEHIND``
        when the client must drain first, or ``Signal.HANDBACK`` when the engine ended or failed
        (read it to see how);
        raises :class:`~narwhal.engines.failures.BoundPassed` (a ``TimeoutError``) on silence or
        the deadline, carrying the bound that passed (also ``timed_out_at``)."""
        conn = self._conn
        self._stopped, self._held, self.timed_out_at = False, None, None
        self._last = self._loop.time()
        conn.sink = self._on_body
        self._arm()
        try:
            pending = conn.take()
            if pending:  # what arrived before the relay started: one span, like any read
                self._on_body(pending[0] if len(pending) == 1 else b"".join(pending))
            while not self._stopped and not conn.failed and not conn.complete:
                await conn.wait()
        finally:
            conn.sink = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if self.timed_out_at is not None:
            raise BoundPassed(self.timed_out_at)
        if self._broken is not None:
            raise self._broken
        if self._held is not None:
            return self._held
        return Signal.BEHIND if self._stopped else Signal.HANDBACK

    def _on_body(self, chunk: bytes) -> None:
        self._last = self._loop.time()
        try:
            span = self._framer.feed(chunk)
        except (EventTooLarge, EventOverBudget) as exc:  # raised from run(), under the leg's WireFailures
            self._broken = exc
            self._stop(None)
            return
        if not span:
            return
        if (b"[DONE]" in span or b'"error"' in span) if self._openai else self._may_end(span):
            self._stop(span)
        else:
            self.spans += 1
            if not self._sink(span):
                self._stop(None)

    def _stop(self, held: bytes | None) -> None:
        self._stopped = True
        self._held = held
        self._conn.sink = None
        self._conn.wake()

    @property
    def last_at(self) -> float:
        """When the last engine bytes arrived (loop time), or the relay last started."""
        return self._last

    def _bound(self) -> float:
        return leg_bound(self._last, self._read_timeout, self._deadline)  # silence counts from the last byte

    def _arm(self) -> None:
        bound = self._bound()
        if bound != math.inf:
            self._timer = self._loop.call_at(bound, self._check)

    def _check(self) -> None:
        self._timer = None
        if self._stopped:
            return
        bound = self._bound()
        if self._loop.time() >= bound:
            self.timed_out_at = bound
            self._stop(None)
        else:
            self._timer = self._loop.call_at(bound, self._check)
