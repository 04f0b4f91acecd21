"""Every reason the router can give for an outcome, in one table (docs/behaviour.md "The request path", "Failure
semantics", "Recovery").

A reason decides five things: the HTTP status a client sees, whether a fresh attempt may cure
it before visible output ("Recovery"), whether it may count against an engine's breaker
("Recovery"), the code it travels under in shared memory (outcome reports and engine records),
and its lines in the fault table the README and docs/behaviour.md show (rendered from here by
``narwhal.fault_table``; a test fails when a committed copy differs). Each used to be its own
list in its own module, the table a copy in two docs; now a reason is defined once, as a member
of :class:`Reason` that carries its :class:`Rule`, and the lists below are derived from it.
``tests/unit/test_reasons.py`` checks that every reason the code raises is one of them.

:class:`Reason` is a ``StrEnum``, so a member *is* its string (``Reason.ENGINE_5XX ==
"engine_5xx"``) wherever it travels — metric labels, log lines, the ``x-narwhal-error`` header,
shared memory's ring codes — and a typo is an ``AttributeError`` at import instead of an unknown
reason at run time.

Ring codes are part of the shared-memory layout: a ``SIGHUP`` reload runs new workers against
the master's region, beside a supervisor that may be older. A code, once given, never changes
or moves; a new reason takes the next free code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Retry(enum.Enum):
    """When a reason's failure may be retried on another engine, before visible output
    (docs/behaviour.md "Recovery").
    """

    NEVER = "never"
    ALWAYS = "always"  # a transient fault before visible output (connect, 5xx, timeouts, …)
    IF_429 = "if_429"  # an engine's 4xx: only overload (429) is worth another engine
    IF_5XX = "if_5xx"  # an error inside a 200 stream: only the engine's own (5xx) fault


Row = tuple[str, str]  # a line of the fault table: what happened, what a client sees


@dataclass(frozen=True, slots=True)
class Rule:
    """What one reason decides (its :class:`Reason` member carries it)."""

    name: str
    status: int | None  # fixed HTTP status; None: the engine's or the error object's own
    retry: Retry
    counts: bool  # may count against the engine it is charged to (docs/behaviour.md "Recovery")
    ring_code: int | None  # its code in shared memory; None: never reported to the supervisor
    rows: tuple[Row, ...] = ()  # its lines in the fault table (``narwhal.fault_table``)


class Reason(enum.StrEnum):
    """Every reason, each defined once: its string (the member's name, lower case), its HTTP
    status (None: the engine's or the error object's own), when a fresh attempt may cure it,
    whether it may count against an engine, its ring code, and its lines in the fault table."""

    rule: Rule

    def __new__(cls, value: str, status: int | None, retry: Retry, counts: bool, ring_code: int | None,
                *rows: Row) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.rule = Rule(value, status, retry, counts, ring_code, rows)
        return member

    # the client's fault, or the router's own refusal: never an engine's
    BAD_REQUEST = "bad_request", 400, Retry.NEVER, False, None
    UNAUTHORIZED = "unauthorized", 401, Retry.NEVER, False, None
    MODEL_NOT_FOUND = (
        "model_not_found", 404, Retry.NEVER, False, None, ("a model no engine serves", "404 `model_not_found`"),
    )
    NOT_FOUND = "not_found", 404, Retry.NEVER, False, None
    METHOD_NOT_ALLOWED = "method_not_allowed", 405, Retry.NEVER, False, None
    REQUEST_TIMEOUT = "request_timeout", 408, Retry.NEVER, False, None
    PAYLOAD_TOO_LARGE = "payload_too_large", 413, Retry.NEVER, False, None
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type", 415, Retry.NEVER, False, None
    HEADER_TOO_LARGE = "header_too_large", 431, Retry.NEVER, False, None
    NO_ENGINE = (
        "no_engine", 503, Retry.NEVER, False, None,
        ("no producer and consumer of one vLLM version and transfer mode",
         "503 `no_engine`, the detail says which versions or modes differ"),
        ("no admitted engine or free reservation in time; every engine of the model out",
         "503 `no_engine` with `Retry-After`"),
    )
    NOT_IMPLEMENTED = (
        "not_implemented", 501, Retry.NEVER, False, None,
        ("no engine serving the model has the endpoint's route in its vLLM release (0.11: Messages, generate)",
         "501 `not_implemented`"),
    )
    SHUTTING_DOWN = (
        "shutting_down", 503, Retry.NEVER, False, None,
        ("the router stops (SIGTERM) and a stream outlives 85 % of the graceful timeout",
         "terminal event `shutting_down` (503)"),
    )
    INTERNAL_ERROR = "internal_error", 500, Retry.NEVER, False, None
    # an engine's fault or answer
    ENGINE_UNREACHABLE = (
        "engine_unreachable", 502, Retry.ALWAYS, True, 1,
        ("connection refused / reset before a response", "502 `engine_unreachable`"),
    )
    ENGINE_5XX = "engine_5xx", 502, Retry.ALWAYS, True, 2, ("engine 5xx (either leg)", "502 `engine_5xx`")
    INVALID_HANDOFF = (
        "invalid_handoff", 502, Retry.ALWAYS, True, 3,
        ("descriptor invalid", "502 `invalid_handoff`, detail `invalid handoff: <reason>`"),
    )
    ENGINE_DISCONNECT = (
        "engine_disconnect", 502, Retry.ALWAYS, True, 4, ("stream closed before `[DONE]`", "502 `engine_disconnect`"),
    )
    DONE_BEFORE_TOKEN = (
        "done_before_token", 502, Retry.ALWAYS, True, 5,
        ("`[DONE]` before any token", "502 `done_before_token`, detail `stream ended with [DONE] before any token "
                                      "arrived`"),
    )
    PREFILL_TIMEOUT = (
        "prefill_timeout", 504, Retry.ALWAYS, True, 6,
        ("prefill slower than `engine.prefill_timeout_s`", "504 `prefill_timeout`"),
    )
    FIRST_TOKEN_TIMEOUT = (
        "first_token_timeout", 504, Retry.ALWAYS, True, 7,
        ("no token within `engine.first_token_timeout_s` (connect + headers included)", "504 `first_token_timeout`"),
    )
    DECODE_SILENCE = (  # only after visible output
        "decode_silence", 504, Retry.NEVER, True, 8,
        ("silence after the first token > `engine.decode_read_timeout_s`",
         "504 `decode_silence`, detail `engine went silent between tokens…`"),
    )
    ENGINE_STREAM_ERROR = (  # counts when 5xx or code absent
        "engine_stream_error", None, Retry.IF_5XX, True, 10,
        ("error object inside a 200 stream", "its own `code` (502 when absent), `type: engine_stream_error`"),
    )
    ENGINE_CLIENT_ERROR = (  # 4xx and 429: never counted
        "engine_client_error", None, Retry.IF_429, False, 11,
        ("engine 4xx (429 included)", "the engine's status and message, `type: engine_client_error`"),
    )
    # the request's own clock or its client
    HANDOFF_EXPIRED = (
        "handoff_expired", 504, Retry.ALWAYS, False, 9,
        ("handoff older than `handoff.max_age_s`",
         "504 `handoff_expired` (the handoff is sent nowhere: its lease may be over)"),
    )
    DEADLINE_EXCEEDED = (
        "deadline_exceeded", 504, Retry.NEVER, False, 12, ("request deadline ran out", "504 `deadline_exceeded`"),
    )
    CLIENT_DISCONNECT = "client_disconnect", None, Retry.NEVER, False, 15
    # the supervisor's own verdicts (engine records' last_failure)
    HEALTH_CHECK = "health_check", None, Retry.NEVER, True, 13
    PROBE = "probe", None, Retry.NEVER, True, 14
    PREFLIGHT = "preflight", None, Retry.NEVER, True, 16


TABLE: tuple[Rule, ...] = tuple(member.rule for member in Reason)

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
