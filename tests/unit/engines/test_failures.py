"""engines.failures.WireFailures: every wire exception inside a leg becomes its reason in one place.

The table below is the mapping the legs relied on when each wrote its own ``except`` clauses:
a timeout is the deadline's when the bound that ran out is the deadline, else the reason of what
the leg was waiting for; a transport error is ``engine_unreachable`` before the response head and
``engine_disconnect`` after it; anything else passes through. The last test keeps the legs from
catching wire exceptions again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import narwhal.engines
from narwhal.engines.failures import BoundPassed, Wait, WireFailures
from narwhal.engines.http1 import ConnectFailed, ConnectionLost, ProtocolError
from narwhal.errors import DeadlineExceeded, EngineError, NarwhalError


def _mapped(exc: BaseException, wire: WireFailures) -> BaseException:
    with pytest.raises(BaseException) as caught:  # noqa: PT011 - the mapped type is the question
        with wire:
            raise exc
    return caught.value


def _wire(wait: Wait, *, deadline: float | None = 100.0, bound: float = 50.0, phase: str = "decode") -> WireFailures:
    return WireFailures("e0", phase, deadline, wait, 2.5, bound)  # type: ignore[arg-type]


@pytest.mark.parametrize(("wait", "phase", "reason", "message"), [
    (Wait.PREFILL, "prefill", "prefill_timeout", "prefill on engine e0 exceeded 2.5s"),
    (Wait.FIRST_TOKEN, "decode", "first_token_timeout", "engine e0 sent no token within 2.5s"),
    (Wait.SILENCE, "decode", "decode_silence", "engine went silent between tokens: engine e0 sent nothing for 2.5s"),
    (Wait.ANSWER, "prefill", "first_token_timeout", "engine e0 sent no answer within 2.5s"),
])
def test_a_timeout_before_the_deadline_is_the_waits_reason(wait: Wait, phase: str, reason: str, message: str) -> None:
    err = _mapped(TimeoutError(), _wire(wait, phase=phase))
    assert type(err) is EngineError
    assert (err.reason, err.message, err.engine, err.phase) == (reason, message, "e0", phase)
    assert err.__suppress_context__ and err.__cause__ is None


@pytest.mark.parametrize(("wait", "message"), [
    (Wait.PREFILL, "the request deadline ran out during prefill"),
    (Wait.FIRST_TOKEN, "the request deadline ran out while decoding"),
    (Wait.SILENCE, "the request deadline ran out while decoding"),
    (Wait.ANSWER, "the request deadline ran out waiting for engine e0"),
])
def test_a_timeout_at_the_deadline_is_deadline_exceeded(wait: Wait, message: str) -> None:
    err = _mapped(TimeoutError(), _wire(wait, deadline=50.0, bound=50.0))
    assert type(err) is DeadlineExceeded and err.message == message and err.reason == "deadline_exceeded"


def test_a_bound_carried_by_the_exception_wins_over_the_scopes() -> None:
    # The relay's silence timer knows its own bound; the scope's is an older one.
    wire = _wire(Wait.SILENCE, deadline=80.0, bound=10.0)
    assert isinstance(_mapped(BoundPassed(80.0), wire), DeadlineExceeded)
    err = _mapped(BoundPassed(70.0), wire)
    assert isinstance(err, EngineError) and err.reason == "decode_silence"


def test_without_a_deadline_a_timeout_is_always_the_engines() -> None:
    err = _mapped(TimeoutError(), _wire(Wait.FIRST_TOKEN, deadline=None, bound=float("inf")))
    assert isinstance(err, EngineError) and err.reason == "first_token_timeout"


@pytest.mark.parametrize(("exc", "message"), [
    (ConnectFailed("cannot connect: ConnectionRefusedError"), "engine e0 is unreachable (prefill)"),
    (ConnectionLost("gone", got_headers=False), "engine e0 closed the connection before a response (prefill)"),
    (ProtocolError("bad"), "engine e0 closed the connection before a response (prefill)"),
])
def test_a_transport_error_before_the_head_is_unreachable(exc: Exception, message: str) -> None:
    err = _mapped(exc, _wire(Wait.PREFILL, phase="prefill"))
    assert isinstance(err, EngineError)
    assert (err.reason, err.message, err.phase, err.status) == ("engine_unreachable", message, "prefill", 502)


def test_a_transport_error_after_the_head_is_a_disconnect_naming_the_terminal_event() -> None:
    wire = _wire(Wait.SILENCE)
    wire.terminal = "message_stop"
    err = _mapped(ConnectionLost("gone", got_headers=True), wire)
    assert isinstance(err, EngineError)
    expected = ("engine_disconnect", "engine e0 closed the stream before message_stop", "decode")
    assert (err.reason, err.message, err.phase) == expected


@pytest.mark.parametrize("exc", [ValueError("x"), ConnectionResetError("client"), EngineError(
    "e", reason="engine_5xx", engine="e0", phase="decode"), DeadlineExceeded("d")])
def test_other_exceptions_pass_through_unchanged(exc: Exception) -> None:
    assert _mapped(exc, _wire(Wait.FIRST_TOKEN)) is exc


def test_the_happy_path_returns_what_the_block_returned() -> None:
    wire = _wire(Wait.FIRST_TOKEN)
    with wire as entered:
        value = 7
    assert entered is wire and value == 7


async def test_cancellation_passes_through() -> None:
    import asyncio

    with pytest.raises(asyncio.CancelledError):
        with _wire(Wait.FIRST_TOKEN):
            raise asyncio.CancelledError


WIRE_NAMES = {"TimeoutError", "UpstreamError", "ConnectFailed", "ConnectionLost", "ProtocolError", "DeadlinePassed"}
LEGS = ("client.py", "decode.py", "relay.py")


def _caught_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    names = (n for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute))
    return {n.id if isinstance(n, ast.Name) else n.attr for n in names}


def test_no_leg_catches_a_wire_exception_itself() -> None:
    root = Path(narwhal.engines.__file__).parent
    found = []
    for name in LEGS:
        for node in ast.walk(ast.parse((root / name).read_text())):
            caught: set[str] = set()
            if isinstance(node, ast.ExceptHandler):
                caught = _caught_names(node.type)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                caught = _caught_names(node.args[1])
            if caught & WIRE_NAMES:
                found.append(f"{name}:{node.lineno}")
    assert found == []


def test_the_mapping_is_a_narwhal_error_for_every_wait() -> None:
    for wait in Wait:
        assert isinstance(_mapped(TimeoutError(), _wire(wait)), NarwhalError)
