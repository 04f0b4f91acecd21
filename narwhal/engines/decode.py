"""One decode leg, the engine's side: open it, then take spans until the stream has ended.

A :class:`DecodeLeg` reads the consumer's answer and applies the stream rules of docs/behaviour.md
"Failure semantics" in named steps — :meth:`open` (POST, read the head under the first-token timer),
:meth:`next_span` (the next bytes for the client), :meth:`close` (pool or close the connection).
What the client sees is decided by its caller; what the engine did is decided here. Before any leg,
``engines.handoff_check.checked_handoff`` is the handoff's own step (docs/behaviour.md "Handoff
validation"): a leg takes only its ``CheckedHandoff``.

The hot path: after the first token, spans that cannot end the stream are handed to the
caller's *sink* from the connection's data callback (``narwhal.engines.relay``), so a long
stream costs no await per token; :meth:`next_span` only wakes for a span that may end the
stream, a client that fell behind (``Signal.BEHIND``: let it drain, then call again), silence,
or the engine's end (``Signal.END`` once the terminal event went out). Before the first token,
metadata events are held and sent along with it.

Why the events after the first token are judged as one span (``_take_rest``): in an unpaced
stream the first span often holds the whole answer, and a probe, a copy and an append per
event would cost more than the rest of the request path's per-event work together; the rest of
the span gets exactly the test a later span gets (the usual end, or output that cannot end
the stream), and only a span that fails it is judged event by event, as before.

The leg's states and their one table of moves are ``narwhal.engines.leg_state``'s; every move
here is checked against it.

Invariants: bytes go out in the order received, each once; no timer spans a return to the
caller (a timer that fired while the caller writes to a slow client would cancel the caller);
a stream that ended cleanly lets its connection be pooled, any other end closes it, which
makes the engine abort the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Required, TypedDict

import orjson

from narwhal.engines import failures, sse
from narwhal.engines.connector import CheckedHandoff
from narwhal.engines.control import EngineRef
from narwhal.engines.dialects.base import event_name
from narwhal.engines.endpoints import Endpoint
from narwhal.engines.failures import Wait
from narwhal.engines.http1 import Connection
from narwhal.engines.leg_state import (
    AWAITING,
    CLOSED,
    ENDED,
    FAILED,
    NEW,
    NEXT,
    READING,
    SENT,
    STREAMING,
    LegState,
    illegal,
)
from narwhal.engines.prefill_result import PrefillResult
from narwhal.engines.relay import DirectRelay, Signal, Sink
from narwhal.engines.timers import LazyTimeout
from narwhal.errors import EngineError

_DRAIN_S = 1.0
# The direct relay has a fixed cost per stream (a timer, a wakeup for the end). The span after
# the first token still takes the caller's path: in an unpaced stream it usually holds the
# whole rest and [DONE], which the caller writes with the end of the body at no extra cost.
# Measured (A/B, perf suite): 1 beats 3 and 0, unpaced and paced (perf/RESULTS.md "Figures behind
# the code's choices").
_RELAY_AFTER = 1


@dataclass(frozen=True, slots=True)
class DecodeContext:
    """What a decode leg needs of the client that made it, and nothing more: the pool's ``post``,
    the engine headers and the two timeouts of docs/behaviour.md "Failure semantics". Built once per
    client (not per leg); the leg imports nothing from ``engines.client``, so the two modules no
    longer import each other."""

    post: Callable[..., Awaitable[Connection]]  # UpstreamPool.post
    engine_headers: Callable[[str, Mapping[str, str] | None], bytes]  # EngineClient.engine_headers
    first_token_timeout_s: float
    decode_read_timeout_s: float
    # The worker's stream buffers: an unfinished event past sse.CHARGED_FROM is charged to them
    # (None: a probe's or preflight's leg, bounded by MAX_EVENT_BYTES alone).
    budget: sse.Budget | None = None


class LegOptions(TypedDict, total=False):
    """What a decode leg takes besides its context, the result, the consumer, the body and the
    validated descriptor (``EngineClient.decode_leg``)."""

    stream: Required[bool]
    deadline: float | None
    endpoint: Endpoint | None
    headers: Mapping[str, str] | None
    sink: Sink | None
    max_age_s: float | None  # the handoff's age bound: its request must be written before it


class DecodeOptions(LegOptions, total=False):
    """A leg's options (``EngineClient.decode`` also checks the handoff against ``max_age_s``)."""


class DecodeLeg:
    """One decode on one consumer, as named steps (the module's text): open, next_span, close."""

    __slots__ = (
        "_ctx", "_name", "_url", "_endpoint", "_request_id", "_headers", "_payload", "streaming", "_deadline",
        "_sink", "_loop", "_first_bound", "_conn", "_framer", "_held", "_state", "_timer", "_relay", "_passed",
        "_error", "_dialect", "_wire", "_expiry", "_out_at",
    )

    def __init__(
        self, ctx: DecodeContext, result: PrefillResult, consumer: EngineRef, body: dict[str, Any],
        descriptor: CheckedHandoff | None,
        *,
        stream: bool,
        deadline: float | None = None,
        endpoint: Endpoint | None = None,
        headers: Mapping[str, str] | None = None,
        sink: Sink | None = None,
        max_age_s: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Build the body around ``descriptor``, already checked (:func:`checked_handoff`);
        ``max_age_s``: the handoff's age bound, which its request's connect and send must beat
        (docs/decisions.md "vLLM releases": a request written after the lease could read blocks given to another);
        ``loop``: the running loop, when the caller holds it (see ``engines.timers``)."""
        decode_endpoint = endpoint or result.endpoint
        self._endpoint = decode_endpoint.path
        self._ctx = ctx
        self._name, self._url = consumer.name, consumer.url
        self._request_id, self._headers = result.request_id, headers
        self._dialect = dialect = decode_endpoint.dialect
        self._payload = orjson.dumps(dialect.decode_body(body, result.request_id, descriptor))
        self.streaming, self._deadline, self._sink = stream, deadline, sink
        self._loop = loop or asyncio.get_running_loop()
        # Streams: connecting and the response head spend the first token's budget (docs/behaviour.md "Failure
        # semantics");
        # a whole answer is bounded by the deadline only.
        first_s = ctx.first_token_timeout_s if stream else 0.0
        self._first_bound = failures.leg_bound(self._loop.time(), first_s, deadline)
        # A handoff's request must be written before it is max_age_s old; a same-worker or local
        # decode (no descriptor) has no lease, and no bound but its own.
        self._expiry: tuple[float, PrefillResult, float] | None = None
        if descriptor is not None and max_age_s is not None:
            by = self._loop.time() + max_age_s - result.age()
            if by < self._first_bound:
                self._expiry = (by, result, max_age_s)
        # Every wait on the wire runs inside it; its wait moves to SILENCE with the first token.
        self._wire = failures.WireFailures(self._name, "decode", deadline, Wait.FIRST_TOKEN,
                                           ctx.first_token_timeout_s, self._first_bound)
        self._conn: Connection | None = None
        self._state = NEW
        self._framer = sse.SSEFramer(ctx.budget)
        self._held: list[bytes] = []  # metadata before the first token, sent along with it
        self._timer: LazyTimeout | None = None
        self._relay: DirectRelay | None = None  # built when first needed: short streams never are
        self._passed = 0  # spans returned after the first token
        self._error: EngineError | None = None  # raised on the call after the output before it
        self._out_at: float | None = None  # when next_span last returned bytes (loop time)

    # -- steps ------------------------------------------------------------------------------

    async def open(self) -> bytes | None:
        """POST the decode and read the head and, for a stream, its first events (a whole answer:
        the body, returned)."""
        assert self._state is NEW, f"decode leg: open() in {self._state.name}"
        head = self._ctx.engine_headers(self._request_id, self._headers)
        with self._wire:
            conn = self._conn = await self._written(head)
            assert SENT in NEXT[self._state], illegal(self._state, SENT)
            self._state = SENT
            try:  # a stream's head and first events in one wakeup, under the first token's bound
                status = await conn.response(first_body=self.streaming)
            finally:  # not a catch: after a stream's 200 head a lost connection is a disconnect
                if self.streaming and conn.status == 200:
                    self._wire.terminal = self._dialect.terminal
            if status != 200:
                raise failures.status_error(status, await conn.read_all(), self._name, "decode")
            data = None if self.streaming else await conn.read_all()
        if data is not None and (err := self._dialect.whole_error(data)) is not None:
            raise failures.stream_error(err, self._name)
        conn.disarm()  # from here each read has its own bound
        if data is not None:
            assert ENDED in NEXT[self._state], illegal(self._state, ENDED)
            self._state = ENDED
        else:
            assert AWAITING in NEXT[self._state], illegal(self._state, AWAITING)
            self._state = AWAITING  # its wire's terminal was set with the 200 head
        return data

    async def _written(self, head: bytes) -> Connection:
        """The request on its way (connected and sent), before the handoff's age runs out: a
        connect or send that would end later is abandoned as ``handoff_expired`` (the wire's
        ``expiry``), never written."""
        expiry = self._expiry
        if expiry is None:
            return await self._ctx.post(self._url, self._endpoint, head, self._payload, deadline=self._first_bound)
        wire = self._wire
        wire.expiry, wire.bound = expiry, expiry[0]
        conn = await self._ctx.post(self._url, self._endpoint, head, self._payload, deadline=expiry[0])
        # Written in time: from here the consumer has it, and the wait for its head is the first
        # token's (a consumer that took the request in time decodes it; queueing is not expiry).
        wire.expiry, wire.bound = None, self._first_bound
        conn.arm(self._first_bound)
        return conn

    async def next_span(self) -> bytes | Literal[Signal.END, Signal.BEHIND]:
        """The next bytes for the client — whole SSE events, the first span holding the first
        token — ``Signal.BEHIND`` when the sink reported the client behind, ``Signal.END`` once
        the terminal event went out."""
        if self._state is FAILED:
            assert self._error is not None
            raise self._error
        assert self._state in READING, f"decode leg: next_span() in {self._state.name}"
        while self._state is not ENDED:
            if self._sink is not None and self._state is STREAMING and self._passed >= _RELAY_AFTER:
                got = await self._relayed()
                if got is Signal.BEHIND:
                    return got
                # HANDBACK: the relay saw the engine end; the read path tells how
                span = await self._read_span() if got is Signal.HANDBACK else got
            else:
                span = await self._read_span()
            if not span:
                continue
            if self._state is STREAMING and not self._dialect.may_end(span):
                self._passed += 1
                self._out_at = self._loop.time()
                return span
            out = await self._classify(span)
            if out is not None:
                self._out_at = self._loop.time()
                return out
        return Signal.END

    @property
    def state(self) -> LegState:
        """Where the leg is (the module's table)."""
        return self._state

    @property
    def sent(self) -> bool:
        """The request went out (read it before close()): a leg that failed connecting (refused,
        or out of time) left the handoff with nobody, and its caller must release it elsewhere."""
        return self._state is not NEW

    @property
    def ended(self) -> bool:
        """The stream reached its terminal event cleanly: the last span may end the client's body."""
        return self._state is ENDED

    @property
    def last_at(self) -> float | None:
        """When the last bytes for the client were read (loop time; the relay's are read in its
        callback and written at once), None before any: where a cut's stall starts."""
        relay = self._relay
        if relay is None or not relay.spans:
            return self._out_at
        return relay.last_at if self._out_at is None else max(relay.last_at, self._out_at)

    @property
    def relayed(self) -> int:
        """Spans the direct relay wrote to the sink (the others were returned by next_span)."""
        return 0 if self._relay is None else self._relay.spans

    def close(self) -> None:
        """Pool the connection after a clean end (its own checks may still close it), else close
        it, which makes the engine abort; a second call does nothing."""
        if self._state is CLOSED:
            return
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        self._framer.close()  # what an unfinished event held goes back to the budget
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._state is ENDED:
                conn.release()
            else:
                conn.close()
        assert CLOSED in NEXT[self._state], illegal(self._state, CLOSED)
        self._state = CLOSED

    # -- inside a step ----------------------------------------------------------------------

    async def _relayed(self) -> bytes | Literal[Signal.BEHIND, Signal.HANDBACK]:
        assert self._conn is not None and self._sink is not None
        if self._relay is None:
            self._relay = DirectRelay(self._conn, self._framer, self._sink, self._ctx.decode_read_timeout_s,
                                      self._deadline, self._dialect.may_end, self._loop)
        with self._wire:  # the relay's silence raises BoundPassed, which carries its bound
            try:
                return await self._relay.run()
            except sse.EventOverBudget as exc:
                raise failures.over_budget(self._name, exc.size) from None

    async def _read_span(self) -> bytes:
        """One read under its bound: the first token's before it, then the silence bound.
        Bytes already buffered (the head and the first events often come in one read) are
        taken at once: no wait, so no timer to arm."""
        conn = self._conn
        assert conn is not None
        if conn.buffered:
            return self._feed(conn.read_now())
        if self._timer is None:
            self._timer = LazyTimeout(self._loop)
        wire = self._wire
        if self._state is STREAMING:
            wire.bound = failures.leg_bound(self._loop.time(), self._ctx.decode_read_timeout_s, self._deadline)
        with wire:  # before the first token its bound is the first token's, set when built
            chunk = await self._timer.wait(conn.read_some(), wire.bound)
        if not chunk:
            raise failures.disconnected(self._name, self._dialect.terminal)
        return self._feed(chunk)

    def _feed(self, chunk: bytes) -> bytes:
        """The framer's spans; an event that never ends is the engine's fault (``sse.EventTooLarge``)."""
        try:
            return self._framer.feed(chunk)
        except sse.EventTooLarge:
            raise failures.disconnected(self._name, self._dialect.terminal) from None
        except sse.EventOverBudget as exc:
            raise failures.over_budget(self._name, exc.size) from None

    async def _classify(self, span: bytes) -> bytes | None:
        """Judge a span that may hold the first token or the stream's end; return what goes to
        the client (None: nothing yet, only metadata so far). AWAITING or STREAMING on entry."""
        dialect = self._dialect
        out = self._held
        if self._state is STREAMING and (cut := dialect.clean_end(span)) >= 0:
            # The usual end: output, the terminal event last, no error: as received.
            out.append(span if cut == len(span) else span[:cut])
            assert ENDED in NEXT[self._state], illegal(self._state, ENDED)
            self._state = ENDED
        events: list[bytes] = [] if self._state is ENDED else sse.split_events(span)
        for i, event in enumerate(events):
            if self._state is STREAMING and not dialect.may_end(event):
                out.append(event + b"\n\n")  # after the first token only the end matters
                continue
            kind, err = dialect.classify(event)
            if kind is sse.Kind.TOKEN:
                if self._state is AWAITING:
                    assert STREAMING in NEXT[self._state], illegal(self._state, STREAMING)
                    self._state = STREAMING
                    self._wire.wait, self._wire.seconds = Wait.SILENCE, self._ctx.decode_read_timeout_s
                    out.append(event + b"\n\n")
                    if self._take_rest(events, i + 1, out):
                        break
                    continue
            elif kind is sse.Kind.DONE:
                if self._state is AWAITING:
                    name = event_name(event)  # the bare name of the terminal event received
                    raise failures.done_before_token(self._name, name.decode() if name else dialect.terminal)
                # What follows the terminal event (vLLM's [DONE] after message_stop) is dropped.
                out.append(dialect.terminal_bytes or event + b"\n\n")
                assert ENDED in NEXT[self._state], illegal(self._state, ENDED)
                self._state = ENDED
                break
            elif kind is sse.Kind.ERROR:
                error = failures.stream_error(err or {}, self._name)
                if self._state is AWAITING or not out:
                    raise error
                assert FAILED in NEXT[self._state], illegal(self._state, FAILED)
                self._error, self._state = error, FAILED  # what came before it goes out first
                self._held = []
                return b"".join(out)
            out.append(event + b"\n\n")
        if self._state is ENDED:
            # Read the end of the chunked body (normally here already) *before* the last span
            # goes out: the caller ends the client's response with it, and a client that has its
            # whole answer may leave at once; nothing may wait after that. A body that ends
            # cleanly lets close() pool the connection (Connection.release checks it did).
            assert self._conn is not None
            if not self._conn.complete:
                await self._conn.read_to_end(_DRAIN_S)
        elif self._state is AWAITING:
            return None
        self._held = []
        return out[0] if len(out) == 1 else b"".join(out)

    def _take_rest(self, events: list[bytes], start: int, out: list[bytes]) -> bool:
        """The events after the first token, judged as one span as a later span would be (the
        usual end as received, or output that cannot end the stream) instead of one by one: an
        unpaced stream's first span often holds the whole answer. False: judge each event."""
        if start >= len(events):
            return True
        rest = b"\n\n".join(events[start:]) + b"\n\n"  # the same bytes the events would add up to
        dialect = self._dialect
        if (cut := dialect.clean_end(rest)) >= 0:
            out.append(rest if cut == len(rest) else rest[:cut])
            assert ENDED in NEXT[self._state], illegal(self._state, ENDED)
            self._state = ENDED
            return True
        if not dialect.may_end(rest):
            out.append(rest)
            return True
        return False
