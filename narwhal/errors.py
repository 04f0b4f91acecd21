"""Every error the router produces, and its one wire shape.

The hierarchy::

    NarwhalError                 reason, status, message -> OpenAI error body + x-narwhal-error
    ├── RequestError             the client's fault (400, 401, 404, 408, 413, 415, 431)
    ├── PlacementError           no_engine (503, Retry-After)
    ├── DeadlineExceeded         deadline_exceeded (504)
    └── EngineError              an engine's fault or answer; knows the engine and the leg
        └── EngineClientError    an engine's 4xx: passed through, never counted against it

Engine errors are raised by the engine client (``narwhal.engines``), which maps transport failures
and the stream rules of docs/behaviour.md "Failure semantics" onto these reasons; each reason's
status, retry rule and breaker weight are in ``narwhal.reasons``.
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["prefill", "decode"]

# Statuses come from the one table of reasons (its module says why there is one).
from narwhal.reasons import STATUS_OF, Reason  # noqa: E402


class NarwhalError(Exception):
    """Any error the router answers with: its reason decides the status (``reasons.TABLE``) unless given."""

    reason: str = Reason.INTERNAL_ERROR
    param: str | None = None  # OpenAI's ``param``: the field at fault, when an engine named one

    def __init__(self, message: str, *, reason: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.message = message
        self.status = status if status is not None else STATUS_OF.get(self.reason, 500)

    def headers(self) -> dict[str, str]:
        """The headers that go with the body: ``x-narwhal-error`` names the reason."""
        return {"x-narwhal-error": self.reason}


class RequestError(NarwhalError):
    """The client's fault, refused before any engine is asked (4xx)."""

    reason = Reason.BAD_REQUEST


class PlacementError(NarwhalError):
    """No engine could take the request in time (503); the client is told when to retry."""

    reason = Reason.NO_ENGINE

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """``x-narwhal-error`` and ``Retry-After``."""
        return {"x-narwhal-error": self.reason, "retry-after": str(self.retry_after_s)}


class DeadlineExceeded(NarwhalError):
    """The request's deadline passed before it could be answered (504)."""

    reason = Reason.DEADLINE_EXCEEDED


class EngineError(NarwhalError):
    """A failed leg. ``counts`` says whether it may count against the engine's breaker;
    ``pair`` is the (producer, consumer) of the attempt it ended, set by that attempt."""

    counts = True
    pair: tuple[str, str] | None = None
    connect_failed = False  # no connection could be made: the engine is unreachable (docs/behaviour.md "Recovery")

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
    """An engine's 4xx (429 included): the client's fault or overload, passed through.

    ``engine_type`` is the ``type`` of the engine's error object (vLLM's request-validation 400s
    say ``"Bad Request"``: who frees a refused handoff depends on it, ``narwhal.fleet.compat``);
    ``param`` the field it named, kept for the client (the OpenAI SDK exposes it)."""

    counts = False

    def __init__(self, message: str, *, engine: str, phase: Phase, status: int,
                 engine_type: str | None = None, param: str | None = None) -> None:
        super().__init__(message, reason=Reason.ENGINE_CLIENT_ERROR, engine=engine, phase=phase, status=status)
        self.engine_type = engine_type
        self.param = param

