"""An unfinished SSE event counts in the worker's stream buffers (docs/behaviour.md "Slow clients").

The framer holds the start of an event until its blank line comes; past ``sse.CHARGED_FROM`` it
charges the worker's budget (``server.max_buffered_mib``, ``request.stream_buffers``) a step at a
time, gives it back as the event completes or the leg closes, and refuses to grow when the budget
is full."""

from __future__ import annotations

import pytest

from narwhal.engines import sse
from narwhal.request.stream_buffers import StreamBuffers

STEP = sse.CHARGED_FROM


def test_an_ordinary_partial_event_charges_nothing() -> None:
    budget = StreamBuffers(1 << 20)
    framer = sse.SSEFramer(budget)
    assert framer.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert framer.feed(b": 2}\n\n") == b'data: {"b": 2}\n\n'
    assert budget.total == 0


def test_a_large_event_is_charged_in_steps_and_given_back_when_it_ends() -> None:
    budget = StreamBuffers(4 * STEP)
    framer = sse.SSEFramer(budget)
    piece = b"x" * (STEP // 2)
    assert framer.feed(b"data: " + piece) == b""
    assert budget.total == 0  # under one step
    framer.feed(piece)
    assert budget.total == 2 * STEP  # just past one step: charged in whole steps, rounded up
    framer.feed(piece + piece)
    assert budget.total == 3 * STEP
    out = framer.feed(b"\n\ndata: y")
    assert out.endswith(b"\n\n") and len(out) == 6 + 4 * len(piece) + 2
    assert budget.total == 0 and framer.pending == len(b"data: y")


def test_the_budget_full_stops_the_event_and_close_gives_back_what_it_held() -> None:
    budget = StreamBuffers(2 * STEP)
    framer = sse.SSEFramer(budget)
    framer.feed(b"data: " + b"x" * (2 * STEP - 100))
    assert budget.total == 2 * STEP
    with pytest.raises(sse.EventOverBudget) as refused:
        framer.feed(b"x" * 200)
    assert refused.value.size == 2 * STEP + 106
    assert budget.total == 2 * STEP  # nothing more was taken
    framer.close()
    framer.close()  # a second close gives back nothing twice
    assert budget.total == 0


def test_without_a_budget_only_the_event_bound_applies() -> None:
    framer = sse.SSEFramer()
    framer.feed(b"data: " + b"x" * (4 * STEP))
    assert framer.pending == 6 + 4 * STEP
    framer.close()
