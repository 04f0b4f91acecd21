"""Where an engine's failures become reasons: transport errors, HTTP statuses, stream errors.

The one place that turns what the wire reports (``narwhal.engines.http1``'s exceptions, a
status, an error object inside a stream, a clock that ran out) into :class:`EngineError` with
its reason, engine, leg and message (SPEC §2, §4). Messages name engines by name, never by URL.
Each reason's status, retry rule and breaker weight are in ``narwhal.reasons``.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from narwhal.engines import sse
from narwhal.engines.connector import PrefillResult
from narwhal.engines.http1 import ConnectFailed, UpstreamError
from narwhal.errors import DeadlineExceeded, EngineClientError, EngineError, Phase
from narwhal.reasons import Reason


def leg_bound(now: float, seconds: float, deadline: float | None) -> float:
    """The one rule for when a leg (or one wait in it) must end, in loop time: ``seconds`` from
    ``now`` (0: no bound of its own), and never past the request's ``deadline``."""
    bound = now + seconds if seconds else math.inf
    return deadline if deadline is not None and deadline < bound else bound


def transport_error(exc: UpstreamError, name: str, phase: Phase) -> EngineError:
    if isinstance(exc, ConnectFailed):
        message = f"engine {name} is unreachable ({phase})"
    else:
        message = f"engine {name} closed the connection before a response ({phase})"
    return EngineError(message, reason=Reason.ENGINE_UNREACHABLE, engine=name, phase=phase)


def engine_message(data: bytes) -> str:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:500].decode("utf-8", "replace").strip()
    if isinstance(obj, dict):
        err = sse.error_object(obj)
        message = err.get("message") if err is not None else None
        if isinstance(message, str):
            return message
        detail = obj.get("detail")  # FastAPI's own 4xx form
        if isinstance(detail, str):
            return detail
    return ""


def status_error(status: int, data: bytes, name: str, phase: Phase) -> EngineError:
    if 400 <= status < 500:
        message = engine_message(data) or f"engine {name} answered HTTP {status}"
        return EngineClientError(message, engine=name, phase=phase, status=status)
    return EngineError(
        f"engine {name} answered HTTP {status} ({phase})", reason=Reason.ENGINE_5XX, engine=name, phase=phase
    )


def stream_error(err: dict[str, Any], name: str, phase: Phase = "decode") -> EngineError:
    """An error the engine reported inside a 200 (a stream's error event, or a whole answer's
    own failure, ``Dialect.whole_error``): its ``code`` when that is a status, else 502; counted
    against the engine on ``phase`` only when 5xx (SPEC §2.1, §4, §6)."""
    code = err.get("code")
    status = code if type(code) is int and 400 <= code <= 599 else 502
    message = err.get("message")
    if not isinstance(message, str) or not message:
        message = f"engine {name} reported an error inside the stream"
    error = EngineError(message, reason=Reason.ENGINE_STREAM_ERROR, engine=name, phase=phase, status=status)
    error.counts = status >= 500
    return error


def expired(result: PrefillResult, max_age_s: float) -> EngineError:
    error = EngineError(
        f"handoff from engine {result.producer} expired after {result.age():.1f}s "
        f"(handoff.max_age_s = {max_age_s:g})",
        reason=Reason.HANDOFF_EXPIRED,
        engine=result.producer,
        phase="prefill",
    )
    error.counts = False  # nobody's fault: a slow queue, not a broken engine
    return error


def disconnected(name: str, terminal: str = "[DONE]") -> EngineError:
    return EngineError(
        f"engine {name} closed the stream before {terminal}", reason=Reason.ENGINE_DISCONNECT, engine=name,
        phase="decode",
    )


def done_before_token(name: str, terminal: str = "[DONE]") -> EngineError:
    """``terminal`` is the bare name of the endpoint's terminal event (SPEC §2.1)."""
    return EngineError(
        f"stream ended with {terminal} before any token arrived", reason=Reason.DONE_BEFORE_TOKEN, engine=name,
        phase="decode",
    )


def decode_timeout(
    name: str, bound: float, deadline: float | None, *, before_token: bool, first_token_s: float, read_s: float
) -> Exception:
    """The request's deadline if that is what ran out, else the engine's fault of the moment."""
    if deadline is not None and bound >= deadline:
        return DeadlineExceeded("the request deadline ran out while decoding")
    if before_token:
        return EngineError(
            f"engine {name} sent no token within {first_token_s:g}s",
            reason=Reason.FIRST_TOKEN_TIMEOUT,
            engine=name,
            phase="decode",
        )
    return EngineError(
        f"engine went silent between tokens: engine {name} sent nothing for {read_s:g}s",
        reason=Reason.DECODE_SILENCE,
        engine=name,
        phase="decode",
    )
