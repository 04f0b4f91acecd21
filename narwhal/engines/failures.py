"""Where an engine's failures become reasons: transport errors, HTTP statuses, stream errors.

The one place that turns what the wire reports (``narwhal.engines.http1``'s exceptions, a status, an
error object inside a stream, a clock that ran out) into :class:`EngineError` with its reason,
engine, leg and message (docs/behaviour.md "The request path", "Failure semantics"). Messages name
engines by name, never by URL. Each reason's status, retry rule and breaker weight are in
``narwhal.reasons``.

The wire's exceptions are mapped by one context manager, :class:`WireFailures`, that every leg
(prefill, decode, release, passthrough) holds around its awaits on the wire, as httpx's
``map_httpcore_exceptions`` does: inside it a ``TimeoutError`` becomes the deadline's error or
the reason of what the leg was waiting for (:class:`Wait`), an ``UpstreamError`` becomes
``engine_unreachable`` before the response head and ``engine_disconnect`` after it. Why one
place: the same two ``except`` clauses were written out eleven times over three modules, each
with its own copy of the deadline test. A leg builds one per leg (not per read) and moves its
``bound`` and ``wait`` with plain attribute writes; outside the exception path it costs the
two calls of a ``with`` per wire await, none per relayed chunk.

Invariant: no leg catches a wire exception itself (``tests/unit/engines/test_failures.py``
checks ``client.py``, ``decode.py`` and ``relay.py``); what the wire layer (``http1*.py``)
catches of its own stays there.
"""

from __future__ import annotations

import enum
import math
from types import TracebackType
from typing import Any

import orjson

from narwhal.engines import sse
from narwhal.engines.http1 import ConnectFailed, UpstreamError
from narwhal.engines.prefill_result import PrefillResult
from narwhal.errors import DeadlineExceeded, EngineClientError, EngineError, NarwhalError, Phase
from narwhal.reasons import Reason


def leg_bound(now: float, seconds: float, deadline: float | None) -> float:
    """The one rule for when a leg (or one wait in it) must end, in loop time: ``seconds`` from
    ``now`` (0: no bound of its own), and never past the request's ``deadline``."""
    bound = now + seconds if seconds else math.inf
    return deadline if deadline is not None and deadline < bound else bound


class Wait(enum.Enum):
    """What a leg waits for: the reason, message and deadline text when its own bound runs out."""

    PREFILL = (Reason.PREFILL_TIMEOUT, "prefill on engine {name} exceeded {seconds:g}s",
               "the request deadline ran out during prefill")
    FIRST_TOKEN = (Reason.FIRST_TOKEN_TIMEOUT, "engine {name} sent no token within {seconds:g}s",
                   "the request deadline ran out while decoding")
    SILENCE = (Reason.DECODE_SILENCE,
               "engine went silent between tokens: engine {name} sent nothing for {seconds:g}s",
               "the request deadline ran out while decoding")
    ANSWER = (Reason.FIRST_TOKEN_TIMEOUT, "engine {name} sent no answer within {seconds:g}s",
              "the request deadline ran out waiting for engine {name}")

    def __init__(self, reason: Reason, message: str, deadline_message: str) -> None:
        self.reason, self.message, self.deadline_message = reason, message, deadline_message


class BoundPassed(TimeoutError):
    """A wait's own ``bound`` (loop time) passed, raised where the leg's scope cannot know which
    bound it was (the direct relay's silence timer, re-armed inside the data callback)."""

    def __init__(self, bound: float) -> None:
        super().__init__()
        self.bound = bound


class WireFailures:
    """The one mapping of wire exceptions to reasons, as a context manager around a leg's awaits.

    ``name`` / ``phase``: the engine and the leg charged; ``deadline``: the request's (loop time,
    None: none); ``wait`` and ``seconds``: what the leg waits for now and its timeout (for the
    message); ``bound``: when the current wait ends; ``terminal``: None until the response head
    was read, then the terminal event the body owes (a connection lost after the head is a
    disconnect before it); ``expiry``: while a decode's request is being written, the handoff's
    own bound (loop time), its result and ``max_age_s`` — a wait that ends there is the handoff's
    expiry, not the engine's fault. The leg moves ``wait``, ``seconds``, ``bound``, ``terminal``
    and ``expiry`` as it goes. Exceptions other than the wire's pass through unchanged."""

    __slots__ = ("name", "phase", "deadline", "wait", "seconds", "bound", "terminal", "expiry")

    def __init__(
        self, name: str, phase: Phase, deadline: float | None, wait: Wait, seconds: float, bound: float
    ) -> None:
        self.name, self.phase, self.deadline = name, phase, deadline
        self.wait, self.seconds, self.bound = wait, seconds, bound
        self.terminal: str | None = None
        self.expiry: tuple[float, PrefillResult, float] | None = None

    def __enter__(self) -> WireFailures:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            return
        if issubclass(kind, TimeoutError):
            raise self.timed_out(exc.bound if isinstance(exc, BoundPassed) else self.bound) from None
        if issubclass(kind, UpstreamError):
            assert isinstance(exc, UpstreamError)
            if self.terminal is not None:
                raise disconnected(self.name, self.terminal) from None
            raise transport_error(exc, self.name, self.phase) from None

    def timed_out(self, bound: float) -> NarwhalError:
        """The request's deadline if that is what ran out, the handoff's age if that did, else
        the reason of the wait."""
        wait, name = self.wait, self.name
        if self.expiry is not None and bound <= self.expiry[0]:
            return expired(self.expiry[1], self.expiry[2])
        if self.deadline is not None and bound >= self.deadline:
            return DeadlineExceeded(wait.deadline_message.format(name=name))
        return EngineError(wait.message.format(name=name, seconds=self.seconds), reason=wait.reason, engine=name,
                           phase=self.phase)


def transport_error(exc: UpstreamError, name: str, phase: Phase) -> EngineError:
    """A transport failure before the response head: ``engine_unreachable`` (refused, or lost)."""
    if isinstance(exc, ConnectFailed):
        message = f"engine {name} is unreachable ({phase})"
    else:
        message = f"engine {name} closed the connection before a response ({phase})"
    error = EngineError(message, reason=Reason.ENGINE_UNREACHABLE, engine=name, phase=phase)
    error.connect_failed = isinstance(exc, ConnectFailed)  # refused: unreachable; lost: it was reached
    return error


def engine_message(data: bytes) -> str:
    """The message of an engine's error answer (its error object's, FastAPI's ``detail``, or the text)."""
    return engine_error(data)[0]


def engine_error(data: bytes) -> tuple[str, str | None, str | None]:
    """An engine's error answer read once: its message (as :func:`engine_message`), its error
    object's ``type`` and ``param`` (each a short string, else None: whatever an engine sends)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:500].decode("utf-8", "replace").strip(), None, None
    if not isinstance(obj, dict):
        return "", None, None
    err = sse.error_object(obj)
    if err is not None:
        message = err.get("message")
        return (message if isinstance(message, str) else "", _short(err.get("type")), _short(err.get("param")))
    detail = obj.get("detail")  # FastAPI's own 4xx form
    return (detail if isinstance(detail, str) else ""), None, None


def _short(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= 200 else None


def status_error(status: int, data: bytes, name: str, phase: Phase) -> EngineError:
    """A non-2xx answer: a 4xx passed through (never counted), anything else ``engine_5xx``."""
    if 400 <= status < 500:
        message, kind, param = engine_error(data)
        return EngineClientError(message or f"engine {name} answered HTTP {status}", engine=name, phase=phase,
                                 status=status, engine_type=kind, param=param)
    return EngineError(
        f"engine {name} answered HTTP {status} ({phase})", reason=Reason.ENGINE_5XX, engine=name, phase=phase
    )


def stream_error(err: dict[str, Any], name: str, phase: Phase = "decode") -> EngineError:
    """An error the engine reported inside a 200 (a stream's error event, or a whole answer's
    own failure, ``Dialect.whole_error``): its ``code`` when that is a status, else 502; counted
    against the engine on ``phase`` only when 5xx (docs/behaviour.md "The other P/D endpoints", "Failure semantics",
    "Recovery")."""
    code = err.get("code")
    status = code if type(code) is int and 400 <= code <= 599 else 502
    message = err.get("message")
    if not isinstance(message, str) or not message:
        message = f"engine {name} reported an error inside the stream"
    error = EngineError(message, reason=Reason.ENGINE_STREAM_ERROR, engine=name, phase=phase, status=status)
    error.counts = status >= 500
    return error


def expired(result: PrefillResult, max_age_s: float) -> EngineError:
    """A handoff older than ``handoff.max_age_s``: ``handoff_expired``, nobody's fault."""
    error = EngineError(
        f"handoff from engine {result.producer} expired after {result.age():.1f}s "
        f"(handoff.max_age_s = {max_age_s:g})",
        reason=Reason.HANDOFF_EXPIRED,
        engine=result.producer,
        phase="prefill",
    )
    error.counts = False  # nobody's fault: a slow queue, not a broken engine
    return error


def unreadable(name: str) -> EngineError:
    """A stream event the router had to rewrite (a continuation's) but could not read: the
    engine's fault (502), counted against it, never a traceback in the relay."""
    error = EngineError(f"engine {name} sent a stream event that could not be read",
                        reason=Reason.ENGINE_STREAM_ERROR, engine=name, phase="decode", status=502)
    error.counts = True
    return error


def disconnected(name: str, terminal: str = "[DONE]") -> EngineError:
    """A stream that ended (cleanly or not) before its terminal event: ``engine_disconnect``."""
    return EngineError(
        f"engine {name} closed the stream before {terminal}", reason=Reason.ENGINE_DISCONNECT, engine=name,
        phase="decode",
    )


def over_budget(name: str, size: int) -> EngineError:
    """An unfinished event of ``size`` bytes the worker's stream buffers cannot hold: the stream
    ends as a disconnect (retried before output, continued after it), never charged to the engine."""
    exc = EngineError(
        f"engine {name} sent an unfinished event of {size} bytes, more than the router's stream buffers hold "
        "now (server.max_buffered_mib)", reason=Reason.ENGINE_DISCONNECT, engine=name, phase="decode",
    )
    exc.counts = False
    return exc


def done_before_token(name: str, terminal: str = "[DONE]") -> EngineError:
    """``terminal`` is the bare name of the endpoint's terminal event (docs/behaviour.md "The other P/D endpoints")."""
    return EngineError(
        f"stream ended with {terminal} before any token arrived", reason=Reason.DONE_BEFORE_TOKEN, engine=name,
        phase="decode",
    )
