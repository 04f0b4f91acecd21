"""The worker's budget for streams waiting on slow clients (narwhal.request.stream_buffers)."""

from __future__ import annotations

import pytest

from narwhal.request.stream_buffers import ENGINE_SIDE, BuffersFull, StreamBuffers


def test_waits_charge_their_buffers_and_give_them_back() -> None:
    buffers = StreamBuffers(3 * ENGINE_SIDE)
    first = buffers.charge(1000)
    second = buffers.charge(0)
    assert (buffers.total, buffers.waiting) == (first + second, 2) and first == 1000 + ENGINE_SIDE
    with pytest.raises(BuffersFull):
        buffers.charge(ENGINE_SIDE)  # past the budget: cut, nothing charged
    assert (buffers.total, buffers.waiting) == (first + second, 2)
    buffers.release(first)
    buffers.release(second)
    assert (buffers.total, buffers.waiting) == (0, 0)


def test_a_lone_slow_client_is_the_write_timeouts_business() -> None:
    buffers = StreamBuffers(1)
    charge = buffers.charge(10 * ENGINE_SIDE)  # the first waiter always fits
    with pytest.raises(BuffersFull):
        buffers.charge(0)
    buffers.release(charge)
    assert buffers.total == 0
