"""Every reason the router can give for an outcome, in one table (SPEC §2, §4, §5, §6).

A reason decides four things: the HTTP status a client sees, whether a fresh attempt may cure
it before visible output (§5), whether it may count against an engine's breaker (§6), and the
code it travels under in shared memory (outcome reports and engine records). Each of those
used to be its own list in its own module, and nothing tied them together; now each is
derived from :data:`TABLE`, and ``tests/unit/test_reasons.py`` checks that every reason the
code raises is in it.

Ring codes are part of the shared-memory layout: a ``SIGHUP`` reload runs new workers against
the master's region, beside a supervisor that may be older. A code, once given, never changes
or moves; a new reason takes the next free code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Retry(enum.Enum):
    NEVER = "never"
    ALWAYS = "always"  # a transient fault before visible output (connect, 5xx, timeouts, …)
    IF_429 = "if_429"  # an engine's 4xx: only overload (429) is worth another engine
    IF_5XX = "if_5xx"  # an error inside a 200 stream: only the engine's own (5xx) fault


@dataclass(frozen=True, slots=True)
class Reason:
    name: str
    status: int | None  # fixed HTTP status; None: the engine's or the error object's own
    retry: Retry
    counts: bool  # may count against the engine it is charged to (SPEC §6)
    ring_code: int | None  # its code in shared memory; None: never reported to the supervisor


TABLE: tuple[Reason, ...] = (
    # the client's fault, or the router's own refusal: never an engine's
    Reason("bad_request", 400, Retry.NEVER, False, None),
    Reason("unauthorized", 401, Retry.NEVER, False, None),
    Reason("model_not_found", 404, Retry.NEVER, False, None),
    Reason("not_found", 404, Retry.NEVER, False, None),
    Reason("method_not_allowed", 405, Retry.NEVER, False, None),
    Reason("request_timeout", 408, Retry.NEVER, False, None),
    Reason("payload_too_large", 413, Retry.NEVER, False, None),
    Reason("unsupported_media_type", 415, Retry.NEVER, False, None),
    Reason("header_too_large", 431, Retry.NEVER, False, None),
    Reason("no_engine", 503, Retry.NEVER, False, None),
    Reason("shutting_down", 503, Retry.NEVER, False, None),
    Reason("internal_error", 500, Retry.NEVER, False, None),
    # an engine's fault or answer
    Reason("engine_unreachable", 502, Retry.ALWAYS, True, 1),
    Reason("engine_5xx", 502, Retry.ALWAYS, True, 2),
    Reason("invalid_handoff", 502, Retry.ALWAYS, True, 3),
    Reason("engine_disconnect", 502, Retry.ALWAYS, True, 4),
    Reason("done_before_token", 502, Retry.ALWAYS, True, 5),
    Reason("prefill_timeout", 504, Retry.ALWAYS, True, 6),
    Reason("first_token_timeout", 504, Retry.ALWAYS, True, 7),
    Reason("decode_silence", 504, Retry.NEVER, True, 8),  # only after visible output
    Reason("engine_stream_error", None, Retry.IF_5XX, True, 10),  # counts when 5xx or code absent
    Reason("engine_client_error", None, Retry.IF_429, False, 11),  # 4xx and 429: never counted
    # the request's own clock or its client
    Reason("handoff_expired", 504, Retry.ALWAYS, False, 9),
    Reason("deadline_exceeded", 504, Retry.NEVER, False, 12),
    Reason("client_disconnect", None, Retry.NEVER, False, 15),
    # the supervisor's own verdicts (engine records' last_failure)
    Reason("health_check", None, Retry.NEVER, True, 13),
    Reason("probe", None, Retry.NEVER, True, 14),
    Reason("preflight", None, Retry.NEVER, True, 16),
)

BY_NAME: dict[str, Reason] = {r.name: r for r in TABLE}

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
