"""Server-sent events as vLLM writes them: framing and the few facts the stream rules need.

Framing is done by hand over ``iter_any()`` chunks rather than with ``readuntil(b"\\n\\n")``:
a separator can be split across TCP reads, and aiohttp's line reader refuses lines over about
128 KiB, while a tool-call or logprobs chunk can be larger than that.

The relay never re-encodes an event. :class:`SSEFramer` returns *spans* of complete events
(bytes exactly as received, CRLF normalised to LF) so they can be written to the client in
one piece, and the classification helpers look into an event only as far as the stream
rules of docs/behaviour.md "Failure semantics" require:

* before the first generated token every event is parsed (once, with orjson) to tell a
  generated token from metadata;
* after it, an event is parsed only when its bytes could be ``[DONE]`` or an error object.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import orjson

from narwhal.engines.http1_errors import UpstreamError

DONE_EVENT = b"data: [DONE]\n\n"
_SEP = b"\n\n"
# One event may be this large (a first chunk with the prompt's logprobs can run to megabytes); an
# engine that sends more without a blank line is broken, and each byte it sent reset the silence
# timer: the framer would have held it without bound.
MAX_EVENT_BYTES = 16 << 20
# Past this, what an unfinished event holds is charged to the worker's budget of stream buffers
# (``server.max_buffered_mib``, ``request.stream_buffers``) in steps of the same size: ordinary
# partial events never reach it, and a thousand streams each holding megabytes of one event
# cannot take a worker past its bound.
CHARGED_FROM = 256 << 10


class EventOverBudget(Exception):
    """An unfinished event the worker's stream buffers cannot take (``failures.over_budget``: the
    stream ends as a disconnect, the consumer not charged: it is the router's memory, not its fault)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"an unfinished event of {size} bytes")
        self.size = size


class Budget(Protocol):
    """A worker's budget of bytes held for streams (``request.stream_buffers.StreamBuffers``)."""

    def hold(self, size: int) -> bool:
        """Keep ``size`` more bytes, if the budget has them (False: it may not)."""

    def free(self, size: int) -> None:
        """Give back ``size`` held bytes."""


class EventTooLarge(UpstreamError):
    """An event grew past :data:`MAX_EVENT_BYTES` without ending: the engine's fault, mapped by the
    leg's ``WireFailures`` like a connection lost mid-stream."""


class SSEFramer:
    """Accumulates transport chunks; ``feed`` returns the complete events received so far."""

    __slots__ = ("buf", "crlf", "_skip_lf", "_budget", "_held")

    def __init__(self, budget: Budget | None = None) -> None:
        # Public, read by the relay to take feed's common case without calling it (relay._on_body).
        self.buf = bytearray()  # the start of an event still to come
        self.crlf = False  # has this stream ever sent a CR?
        self._skip_lf = False  # the last chunk ended in CR: an LF opening the next one is its pair
        self._budget = budget  # the worker's, charged past CHARGED_FROM (None: not charged)
        self._held = 0  # bytes charged to it now

    def feed(self, chunk: bytes) -> bytes:
        """Return the bytes of every event completed by ``chunk`` (possibly ``b""``)."""
        if self.crlf or b"\r" in chunk:
            # Normalise: vLLM writes LF, other servers may write CRLF or lone CR. A CR that
            # ends a chunk ends its line at once; its LF, if it comes next, is dropped then.
            self.crlf = True
            if self._skip_lf and chunk.startswith(b"\n"):
                chunk = chunk[1:]
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not self.buf:
            if chunk.endswith(_SEP):
                return chunk  # the common case: whole events, no copy at all (one call)
            end = chunk.rfind(_SEP)
            if end == -1:
                self.buf += chunk
                if len(self.buf) > CHARGED_FROM or self._held:
                    self._bounded()
                return b""
            end += 2
            if end == len(chunk):
                return chunk  # the common case: whole events, no copy at all
            self.buf += chunk[end:]
            if len(self.buf) > CHARGED_FROM or self._held:
                self._bounded()
            return chunk[:end]
        self.buf += chunk
        end = self.buf.rfind(_SEP)
        if end == -1:
            if len(self.buf) > CHARGED_FROM or self._held:
                self._bounded()
            return b""
        end += 2
        out = bytes(self.buf[:end])
        del self.buf[:end]
        if self._held:
            self._bounded()
        return out

    def _bounded(self) -> None:
        """What the unfinished event holds, within its bounds: :data:`MAX_EVENT_BYTES` for the
        event, and past :data:`CHARGED_FROM` the worker's budget, charged and given back a step
        at a time (the budget full: :class:`EventOverBudget`)."""
        size = len(self.buf)
        if size > MAX_EVENT_BYTES:
            raise EventTooLarge(f"an event of over {MAX_EVENT_BYTES} bytes without end")
        budget = self._budget
        if budget is None:
            return
        want = -(-size // CHARGED_FROM) * CHARGED_FROM if size > CHARGED_FROM else 0  # whole steps
        if want > self._held:
            if not budget.hold(want - self._held):
                raise EventOverBudget(size)
            self._held = want
        elif want < self._held:
            budget.free(self._held - want)
            self._held = want

    def close(self) -> None:
        """The stream ended: whatever was charged to the budget is given back (a second call does nothing)."""
        if self._held and self._budget is not None:
            self._budget.free(self._held)
        self._held = 0

    @property
    def pending(self) -> int:
        """Bytes held back, waiting for the rest of their event."""
        return len(self.buf)


def split_events(span: bytes) -> list[bytes]:
    """Split a span returned by :meth:`SSEFramer.feed` into events (without separators)."""
    return [e for e in span.split(_SEP) if e]


def event_data(event: bytes) -> bytes | None:
    """The event's data (``data:`` lines joined by LF), or None for comment-only events."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # one data line, as engines send nearly every event: nothing to join
    parts: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    if not parts:
        return None
    return b"\n".join(parts)


class Kind(enum.Enum):
    """What an event is to the request path: metadata, generated output, the terminal event or an error."""

    METADATA = "metadata"  # role-only deltas, usage-only chunks, comments, unknown events
    TOKEN = "token"  # generated output: text, content, reasoning, tool calls or finish_reason
    DONE = "done"
    ERROR = "error"


def classify(event: bytes) -> tuple[Kind, dict[str, Any] | None]:
    """Classify one event; for ``ERROR`` also return the error object."""
    data = event_data(event)
    if data is None:
        return Kind.METADATA, None
    if data.strip() == b"[DONE]":
        return Kind.DONE, None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Kind.METADATA, None
    # Exact types (``type(x) is dict``): orjson's values are never subclasses, and these run
    # on every event before the first token.
    if type(obj) is not dict:
        return Kind.METADATA, None
    if "error" in obj or obj.get("object") == "error":  # what error_object looks at
        err = error_object(obj)
        if err is not None:
            return Kind.ERROR, err
    choices = obj.get("choices")
    if type(choices) is list:
        for choice in choices:
            if type(choice) is dict and _is_generated(choice):
                return Kind.TOKEN, None
    return Kind.METADATA, None


def _is_generated(choice: dict[str, Any]) -> bool:
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta")
    if type(delta) is dict:
        # Reasoning is generated output: ``reasoning`` from vLLM 0.2x on, ``reasoning_content``
        # in 0.11. Not counting it would hold the 200 through a whole thinking phase and let
        # the first-token timeout turn a healthy long think into a 504 charged to the consumer.
        return bool(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content")
                    or delta.get("tool_calls"))
    return False


def error_object(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The error inside a decoded body: ``{"error": {...}}`` or vLLM's old flat form."""
    err = obj.get("error")
    if isinstance(err, dict):
        return err
    if obj.get("object") == "error":
        return obj
    if isinstance(err, str):  # some servers send {"error": "message"}
        return {"message": err}
    return None


def may_end_stream(span: bytes) -> bool:
    """Cheap test on a span after the first token: could it hold ``[DONE]`` or an error?"""
    return b"[DONE]" in span or b'"error"' in span


def ends_with_done(span: bytes) -> bool:
    """Is ``span`` (whole events) the usual end of a stream — events, then ``[DONE]`` as the
    last event and the only one, and no error object anywhere? Then it can go out untouched."""
    n = _DONE_LEN
    size = len(span)
    return (
        span.endswith(DONE_EVENT)
        and (size == n or span[-n - 2 : -n] == _SEP)
        and span.find(b"[DONE]") == size - 8
        and b'"error"' not in span
    )


_DONE_LEN = len(DONE_EVENT)
