"""Every error the router produces, and its one wire shape.

The hierarchy::

    NarwhalError                 reason, status, message -> OpenAI error body + x-narwhal-error
    ├── RequestError             the client's fault (400, 401, 404, 408, 413, 415, 431)
    ├── PlacementError           no_engine (503, Retry-After)
    ├── DeadlineExceeded         deadline_exceeded (504)
    └── EngineError              an engine's fault or answer; knows the engine and the leg
        └── EngineClientError    an engine's 4xx: passed through, never counted against it

Engine errors are raised in exactly one place (``narwhal.engines.client``), which maps
aiohttp's exceptions and the stream rules of SPEC §4 onto these reasons.
"""

from __future__ import annotations

from typing import Literal

import orjson

Phase = Literal["prefill", "decode"]

# reason -> HTTP status, for the reasons whose status is fixed (SPEC §2).
STATUS_OF: dict[str, int] = {
    "bad_request": 400,
    "unauthorized": 401,
    "model_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "request_timeout": 408,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "header_too_large": 431,
    "no_engine": 503,
    "shutting_down": 503,
    "engine_unreachable": 502,
    "engine_5xx": 502,
    "invalid_handoff": 502,
    "engine_disconnect": 502,
    "done_before_token": 502,
    "prefill_timeout": 504,
    "first_token_timeout": 504,
    "decode_silence": 504,
    "handoff_expired": 504,
    "deadline_exceeded": 504,
    "internal_error": 500,
}


class NarwhalError(Exception):
    reason: str = "internal_error"

    def __init__(self, message: str, *, reason: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.message = message
        self.status = status if status is not None else STATUS_OF.get(self.reason, 500)

    def body(self) -> bytes:
        return error_body(self.message, self.reason, self.status)

    def sse_event(self) -> bytes:
        """The terminal event that ends a stream whose 200 was already committed."""
        return b"data: " + self.body() + b"\n\n"

    def headers(self) -> dict[str, str]:
        return {"x-narwhal-error": self.reason}


class RequestError(NarwhalError):
    reason = "bad_request"


class PlacementError(NarwhalError):
    reason = "no_engine"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"x-narwhal-error": self.reason, "retry-after": str(self.retry_after_s)}


class DeadlineExceeded(NarwhalError):
    reason = "deadline_exceeded"


class EngineError(NarwhalError):
    """A failed leg. ``counts`` says whether it may count against the engine's breaker."""

    counts = True

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        engine: str,
        phase: Phase,
        status: int | None = None,
    ) -> None:
        super().__init__(message, reason=reason, status=status)
        self.engine = engine
        self.phase = phase


class EngineClientError(EngineError):
    """An engine's 4xx (429 included): the client's fault or overload, passed through."""

    counts = False

    def __init__(self, message: str, *, engine: str, phase: Phase, status: int) -> None:
        super().__init__(message, reason="engine_client_error", engine=engine, phase=phase, status=status)


def error_body(message: str, kind: str, status: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})
