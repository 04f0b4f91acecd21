"""A stream's migration (:class:`Migration`): a stream cut after visible output continues on another pair.

A decode that fails after its client saw output — the engine disconnected, sent a 5xx, fell
silent, or (for a continuation not yet under way) could not be reached — used to end with the
terminal event docs/behaviour.md "Failure semantics" gives a fault after the first token. With
``recovery.max_migrations`` > 0 the router instead runs a fresh attempt (a new prefill and
handoff, the failed consumer avoided) that asks vLLM to continue the output so far
(``forms``), and rewrites what it sends into the stream the client was reading (``splice``):
one stream, every token once and in order (docs/behaviour.md "Migration").

The parts, per request:

- the transcript (``transcript``): the spans the client was sent, kept by the client's own
  writes (``request.client_stream``) with no parsing on the way (the relay's rule: no JSON work
  per chunk), and read (``seen``) only when a cut asks for a continuation;
- in front of the client's sink while a continuation runs, its rewrite (``splice``): only a
  continuation's spans are parsed and re-encoded;
- whether a cut continues (the reason, the count, the deadline; the router asks the budget),
  and the continuation request.

All three are one :class:`Migration` per stream: one object, no allocation per attempt or span.

Invariant: a stream that never migrates pays one call per span (the transcript's ``keep``) and
no sink of its own; the JSON work happens only on a cut, and on the spans of a continuation.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import orjson

from narwhal import metrics
from narwhal.engines.relay import Sink
from narwhal.engines.sse import DONE_EVENT
from narwhal.errors import EngineError
from narwhal.reasons import migrates
from narwhal.request.admission import ClientRequest
from narwhal.request.migration.forms import KINDS, NotContinued, continuation, never_continued
from narwhal.request.migration.seen import Seen
from narwhal.request.migration.splice import MessagesSplice, Splice
from narwhal.request.migration.transcript import Transcript
from narwhal.request.stream_buffers import StreamBuffers

log = logging.getLogger("narwhal.request.migration")

_IDENTITY = ("id", "request_id", "object", "created", "model")  # what a usage chunk repeats of the stream's events

class Migration:
    """One stream's continuations: the transcript of what its client was sent (kept unparsed,
    read when a cut asks), the count, the next continuation request; and, while a continuation
    runs, the sink in front of the client's (``sink``) that rewrites its spans."""

    __slots__ = ("count", "_limit", "_prompt", "_kind", "transcript", "_seen", "last_at", "clock",
                 "_inner", "_edit", "_stalled", "_body", "unreadable")

    def __init__(self, kind: str, limit: int, prompt: dict[str, Any], clock: Callable[[], float],
                 body: dict[str, Any] | None = None, buffers: StreamBuffers | None = None) -> None:
        self.count = 0  # continuations started
        self._body = body  # the client's body: whether it may ever continue is asked at a cut, not per request
        self.unreadable = False  # a continuation's event could not be rewritten: the engine's fault
        self._limit = limit
        self._prompt = prompt  # the prompt fields' values (the body may hold them encoded)
        self._kind = kind
        self.transcript = Transcript(buffers)  # what the client was sent, kept by the client's writes
        self._seen: Seen | None = None  # what the spans read so far said
        self.last_at: float | None = None  # when the cut leg's last output went out (loop time)
        self.clock = clock
        self._inner: Sink | None = None  # the attempt's sink behind this one (the client's)
        self._edit: Callable[[bytes], bytes] | None = None  # the current continuation's rewrite
        self._stalled: float | None = None  # a continuation under way: when the output stopped

    @classmethod
    def of(cls, req: ClientRequest, limit: int, clock: Callable[[], float],
           buffers: StreamBuffers | None = None) -> Migration | None:
        """A streamed request on an endpoint that continues, with migrations on; else None."""
        kind = KINDS.get(req.endpoint)
        if not req.stream or limit <= 0 or kind is None:
            return None
        return cls(kind, limit, req.prompt, clock, req.body, buffers)

    # -- a continuation's sink ----------------------------------------------------------------

    @property
    def editing(self) -> bool:
        """A continuation runs: its spans are rewritten (``passing``) before the client sees them."""
        return self._edit is not None

    @property
    def continuing(self) -> bool:
        """A continuation runs and its output already reached the client."""
        return self._edit is not None and self._stalled is None

    def sink(self, inner: Sink) -> Sink:
        """The sink of the attempt starting now: ``inner`` itself, or this stream's rewrite in
        front of it while a continuation runs."""
        if self._edit is None:
            return inner
        self._inner = inner
        return self

    def __call__(self, span: bytes) -> bool:
        span = self.passing(span)
        if self.unreadable:
            return False  # stops the relay (as a client behind does): its caller raises the fault
        assert self._inner is not None
        return self._inner(span) if span else True

    def passing(self, span: bytes) -> bytes:
        """What of a continuation's ``span`` goes to the client (``b""``: metadata not repeated,
        or an event that could not be rewritten, which sets :attr:`unreadable`). Never raises:
        it runs inside the engine connection's data callback."""
        assert self._edit is not None
        try:
            span = self._edit(span)
        except Exception:  # whatever an engine sends may not raise here (its caller charges it)
            log.warning("a continuation's event could not be rewritten: %r", span[:200], exc_info=True)
            self.unreadable = True
            return b""
        if span and self._stalled is not None:
            metrics.TALLY.observe(metrics.MIGRATION_STALL_SAMPLES, self.clock() - self._stalled)
            self._stalled = None
        return span

    def read(self) -> Seen:
        """What the client saw, every span sent so far read."""
        seen = self._seen
        if seen is None:
            seen = self._seen = Seen(self._kind)
        return self.transcript.read(seen)

    # -- a cut --------------------------------------------------------------------------------

    def finished(self) -> bool:
        """The stream's finish already reached its client (read from the last spans sent only):
        a cut now is an early close of a complete stream, never continued."""
        tail = Seen(self._kind)
        tail.absorb(self.transcript.tail())
        return tail.finished

    def completion(self, wants_usage: bool, prompt_tokens: int | None) -> bytes:
        """What ends a stream cut after its finish as a complete one: the usage chunk from
        Narwhal's own count (when the client asked for usage, it was not sent, and the prompt's
        count is known), then the end marker (``[DONE]``; Messages: ``message_stop``)."""
        if self._kind == "messages":
            return b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
        if self.transcript.full:  # nothing left to count from (its memory bound): the end marker alone
            return DONE_EVENT
        seen = self.read()
        usage = b""
        if wants_usage and not seen.usage_sent and prompt_tokens is not None and seen.last is not None:
            done = seen.tokens
            chunk = {k: v for k, v in seen.last.items() if k in _IDENTITY}
            chunk["choices"] = []
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + done,
                              "completion_tokens": done}
            usage = b"data: " + orjson.dumps(chunk) + b"\n\n"
        return usage + DONE_EVENT

    def may_continue(self, exc: EngineError, deadline: float, now: float) -> bool:
        """May the cut ``exc`` be continued, as far as this stream alone says (its count, the
        fault's reason, the deadline)? Nothing of the transcript is read: the router asks the
        fleet's bound next, and only then :meth:`after`."""
        never = None if self._body is None else never_continued(self._body)
        if never is not None:
            log.info("stream not continued after %s: %s", exc.reason, never)
            return False
        if self.transcript.full:
            log.info("stream not continued after %s: its transcript passed its memory bound", exc.reason)
            return False
        return self.count < self._limit and migrates(exc.reason, exc.status) and now < deadline

    def after(self, exc: EngineError, req: ClientRequest, now: float, prompt_tokens: int | None) -> \
            ClientRequest | None:
        """The request that continues the stream ``exc`` cut (``req``: the client's), once
        :meth:`may_continue` and the fleet's bound said yes; None when no faithful continuation
        exists (logged)."""
        seen = self.read()
        try:
            endpoint, body = continuation(req.endpoint, req.body, self._prompt, seen)
        except NotContinued as why:
            log.info("stream not continued after %s: %s", exc.reason, why)
            return None
        kind = self._kind
        self._edit = MessagesSplice(seen, prompt_tokens) if kind == "messages" else Splice(kind, seen, prompt_tokens)
        self._stalled = self.last_at if self.last_at is not None else now
        self.count += 1
        return dataclasses.replace(req, endpoint=endpoint, body=body, stream=True)
