"""The one table of reasons (narwhal.reasons): complete, and its ring codes frozen."""

from __future__ import annotations

import ast
from pathlib import Path

from narwhal import reasons
from narwhal.reasons import RETRYABLE, RING_CODE, RING_NAMES, STATUS_OF, TABLE, UNCOUNTED_REASONS, Reason, retryable

PACKAGE = Path(reasons.__file__).resolve().parent
# Reason strings name router outcomes only here; the fake engine has vocabularies of its own.
OUTSIDE = {"fake_engine"}


def _raised_reasons() -> dict[str, str]:
    """Every reason the router passes or assigns (a string literal or a ``Reason`` member),
    with where it is."""
    found: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        if OUTSIDE & set(path.relative_to(PACKAGE).parts) or path.name == "reasons.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            values: list[ast.expr] = []
            if isinstance(node, ast.keyword) and node.arg in ("reason", "last_failure_reason"):
                values.append(node.value)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "reason" for t in node.targets):
                values.append(node.value)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "health_failed":
                values.extend(node.args[1:])
            for value in values:
                where = f"{path.relative_to(PACKAGE)}:{value.lineno}"
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found[value.value] = where
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "Reason":
                found[Reason[node.attr].value] = f"{path.relative_to(PACKAGE)}:{node.lineno}"
    return found


def test_every_reason_the_code_gives_is_in_the_table() -> None:
    raised = _raised_reasons()
    assert len(raised) > 20  # the scan really sees the code
    names = {r.name for r in TABLE}
    missing = {name: where for name, where in raised.items() if name not in names}
    assert missing == {}


def test_the_enum_names_exactly_the_tables_reasons() -> None:
    assert [r.value for r in Reason] == [r.name for r in TABLE]
    assert all(member == member.value and isinstance(member, str) for member in Reason)  # travels as its string
    assert all(member.name == member.value.upper() for member in Reason)


def test_names_are_unique() -> None:
    assert len({r.name for r in TABLE}) == len(TABLE)


def test_ring_codes_never_move() -> None:
    # The shared-memory layout of every release so far: a reload runs new workers against
    # the master's region, so these may only ever be appended to.
    assert RING_NAMES == (
        "", "engine_unreachable", "engine_5xx", "invalid_handoff", "engine_disconnect", "done_before_token",
        "prefill_timeout", "first_token_timeout", "decode_silence", "handoff_expired", "engine_stream_error",
        "engine_client_error", "deadline_exceeded", "health_check", "probe", "client_disconnect", "preflight",
    )
    assert RING_CODE["engine_5xx"] == 2 and RING_CODE[""] == 0


def test_the_derived_lists_say_what_the_spec_says() -> None:
    assert STATUS_OF["no_engine"] == 503 and STATUS_OF["decode_silence"] == 504 and STATUS_OF["bad_request"] == 400
    assert "engine_client_error" not in STATUS_OF and "engine_stream_error" not in STATUS_OF
    assert RETRYABLE == {
        "engine_unreachable", "engine_5xx", "engine_disconnect", "prefill_timeout", "first_token_timeout",
        "invalid_handoff", "handoff_expired", "done_before_token",
    }
    assert {"engine_client_error", "handoff_expired", "deadline_exceeded", "client_disconnect", "shutting_down",
            "no_engine"} <= UNCOUNTED_REASONS
    assert not UNCOUNTED_REASONS & {"engine_5xx", "decode_silence", "engine_stream_error", "health_check"}


def test_retryable_by_status_where_the_reason_alone_does_not_decide() -> None:
    assert retryable("engine_client_error", 429) and not retryable("engine_client_error", 400)
    assert retryable("engine_stream_error", 503) and not retryable("engine_stream_error", 400)
    assert retryable("engine_5xx", 502) and not retryable("decode_silence", 504)
    assert not retryable("no_such_reason", 502)
