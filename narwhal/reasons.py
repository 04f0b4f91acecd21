"""Every reason the router can give for an outcome, in one table (docs/behaviour.md "The request path", "Failure
semantics", "Recovery").

A reason decides four things: the HTTP status a client sees, whether a fresh attempt may cure
it before visible output ("Recovery"), whether it may count against an engine's breaker ("Recovery"), and the
code it travels under in shared memory (outcome reports and engine records). Each of those
used to be its own list in its own module, and nothing tied them together; now each is
derived from :data:`TABLE`, and ``tests/unit/test_reasons.py`` checks that every reason the
code raises is in it.

:class:`Reason` names the same reasons for the code that raises them: a ``StrEnum``, so a
member *is* its string (``Reason.ENGINE_5XX == "engine_5xx"``) wherever it travels — metric
labels, log lines, the ``x-narwhal-error`` header, shared memory's ring codes — and a typo is an
``AttributeError`` at import instead of an unknown reason at run time. The test proves the enum
and the table list the same names.

Ring codes are part of the shared-memory layout: a ``SIGHUP`` reload runs new workers against
the master's region, beside a supervisor that may be older. A code, once given, never changes
or moves; a new reason takes the next free code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Retry(enum.Enum):
    """When a reason's failure may be retried on another engine, before visible output (docs/behaviour.md
    "Recovery").
    """

    NEVER = "never"
    ALWAYS = "always"  # a transient fault before visible output (connect, 5xx, timeouts, …)
    IF_429 = "if_429"  # an engine's 4xx: only overload (429) is worth another engine
    IF_5XX = "if_5xx"  # an error inside a 200 stream: only the engine's own (5xx) fault


class Reason(enum.StrEnum):
    """Every reason in :data:`TABLE`, by name, for raise sites (equal to its string)."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TIMEOUT = "request_timeout"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    HEADER_TOO_LARGE = "header_too_large"
    NO_ENGINE = "no_engine"
    NOT_IMPLEMENTED = "not_implemented"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"
    ENGINE_UNREACHABLE = "engine_unreachable"
    ENGINE_5XX = "engine_5xx"
    INVALID_HANDOFF = "invalid_handoff"
    ENGINE_DISCONNECT = "engine_disconnect"
    DONE_BEFORE_TOKEN = "done_before_token"
    PREFILL_TIMEOUT = "prefill_timeout"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    DECODE_SILENCE = "decode_silence"
    ENGINE_STREAM_ERROR = "engine_stream_error"
    ENGINE_CLIENT_ERROR = "engine_client_error"
    HANDOFF_EXPIRED = "handoff_expired"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CLIENT_DISCONNECT = "client_disconnect"
    HEALTH_CHECK = "health_check"
    PROBE = "probe"
    PREFLIGHT = "preflight"


@dataclass(frozen=True, slots=True)
class Rule:
    """What one reason decides."""

    name: str
    status: int | None  # fixed HTTP status; None: the engine's or the error object's own
    retry: Retry
    counts: bool  # may count against the engine it is charged to (docs/behaviour.md "Recovery")
    ring_code: int | None  # its code in shared memory; None: never reported to the supervisor


TABLE: tuple[Rule, ...] = (
    # the client's fault, or the router's own refusal: never an engine's
    Rule("bad_request", 400, Retry.NEVER, False, None),
    Rule("unauthorized", 401, Retry.NEVER, False, None),
    Rule("model_not_found", 404, Retry.NEVER, False, None),
    Rule("not_found", 404, Retry.NEVER, False, None),
    Rule("method_not_allowed", 405, Retry.NEVER, False, None),
    Rule("request_timeout", 408, Retry.NEVER, False, None),
    Rule("payload_too_large", 413, Retry.NEVER, False, None),
    Rule("unsupported_media_type", 415, Retry.NEVER, False, None),
    Rule("header_too_large", 431, Retry.NEVER, False, None),
    Rule("no_engine", 503, Retry.NEVER, False, None),
    Rule("not_implemented", 501, Retry.NEVER, False, None),  # no engine's release serves the endpoint
    Rule("shutting_down", 503, Retry.NEVER, False, None),
    Rule("internal_error", 500, Retry.NEVER, False, None),
    # an engine's fault or answer
    Rule("engine_unreachable", 502, Retry.ALWAYS, True, 1),
    Rule("engine_5xx", 502, Retry.ALWAYS, True, 2),
    Rule("invalid_handoff", 502, Retry.ALWAYS, True, 3),
    Rule("engine_disconnect", 502, Retry.ALWAYS, True, 4),
    Rule("done_before_token", 502, Retry.ALWAYS, True, 5),
    Rule("prefill_timeout", 504, Retry.ALWAYS, True, 6),
    Rule("first_token_timeout", 504, Retry.ALWAYS, True, 7),
    Rule("decode_silence", 504, Retry.NEVER, True, 8),  # only after visible output
    Rule("engine_stream_error", None, Retry.IF_5XX, True, 10),  # counts when 5xx or code absent
    Rule("engine_client_error", None, Retry.IF_429, False, 11),  # 4xx and 429: never counted
    # the request's own clock or its client
    Rule("handoff_expired", 504, Retry.ALWAYS, False, 9),
    Rule("deadline_exceeded", 504, Retry.NEVER, False, 12),
    Rule("client_disconnect", None, Retry.NEVER, False, 15),
    # the supervisor's own verdicts (engine records' last_failure)
    Rule("health_check", None, Retry.NEVER, True, 13),
    Rule("probe", None, Retry.NEVER, True, 14),
    Rule("preflight", None, Retry.NEVER, True, 16),
)

BY_NAME: dict[str, Rule] = {r.name: r for r in TABLE}

# reason -> HTTP status, for the reasons whose status is fixed.
STATUS_OF: dict[str, int] = {r.name: r.status for r in TABLE if r.status is not None}
# Transient faults before visible output that a fresh attempt may cure whatever their status.
RETRYABLE: frozenset[str] = frozenset(r.name for r in TABLE if r.retry is Retry.ALWAYS)
# Never counted against an engine, even if a report says otherwise (belt and braces).
UNCOUNTED_REASONS: frozenset[str] = frozenset(r.name for r in TABLE if not r.counts)


def _ring_names() -> tuple[str, ...]:
    coded = {r.ring_code: r.name for r in TABLE if r.ring_code is not None}
    assert len(coded) == sum(r.ring_code is not None for r in TABLE), "two reasons share a ring code"
    top = max(coded)
    assert set(coded) == set(range(1, top + 1)), "ring codes must be dense from 1"
    return ("", *(coded[i] for i in range(1, top + 1)))


# Code -> name in shared memory; code 0 is "no reason".
RING_NAMES: tuple[str, ...] = _ring_names()
RING_CODE: dict[str, int] = {name: code for code, name in enumerate(RING_NAMES)}


def migrates(reason: str, status: int) -> bool:
    """May a stream cut by this failure *after* visible output continue on another pair
    (docs/behaviour.md "Migration")? An engine's own fault — a disconnect, a 5xx (in the stream
    too), silence, a refused connect, or any transient fault of a continuation before its first
    token — yes; an engine's 4xx, the client, the deadline and a shutdown, never."""
    if reason == Reason.DECODE_SILENCE:
        return True
    found = BY_NAME.get(reason)
    if found is None or found.retry is Retry.IF_429:
        return False
    return retryable(reason, status)


def retryable(reason: str, status: int) -> bool:
    """May a fresh attempt cure this failure (before visible output, budget permitting)?"""
    found = BY_NAME.get(reason)
    if found is None:
        return False
    if found.retry is Retry.IF_429:
        return status == 429
    if found.retry is Retry.IF_5XX:
        return status >= 500
    return found.retry is Retry.ALWAYS
