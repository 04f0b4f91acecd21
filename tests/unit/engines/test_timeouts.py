"""LazyTimeout: one lazily re-armed timer per stream instead of a timeout per read."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from narwhal.engines.timers import LazyTimeout


class Source:
    """A stand-in for aiohttp's StreamReader: readany() waits for the next queued chunk."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def readany(self) -> bytes:
        return await self.queue.get()


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_data_before_the_bound_is_returned() -> None:
    src, timer = Source(), LazyTimeout()
    src.queue.put_nowait(b"a")
    assert await timer.wait(src.readany(), now() + 1) == b"a"  # type: ignore[arg-type]
    timer.close()


async def test_silence_past_the_bound_raises_timeout() -> None:
    src, timer = Source(), LazyTimeout()
    started = now()
    with pytest.raises(TimeoutError):
        await timer.wait(src.readany(), now() + 0.05)  # type: ignore[arg-type]
    assert now() - started >= 0.05
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    timer.close()


async def test_time_spent_outside_a_read_is_not_silence() -> None:
    src, timer = Source(), LazyTimeout()
    src.queue.put_nowait(b"a")
    assert await timer.wait(src.readany(), now() + 0.05) == b"a"  # type: ignore[arg-type]
    await asyncio.sleep(0.1)  # the caller is busy writing: the timer fires, finds no read, waits
    src.queue.put_nowait(b"b")
    assert await timer.wait(src.readany(), now() + 0.05) == b"b"  # type: ignore[arg-type]
    timer.close()


async def test_a_moving_bound_re_arms_instead_of_firing_early() -> None:
    src, timer = Source(), LazyTimeout()

    async def feed() -> None:
        for _ in range(5):
            await asyncio.sleep(0.03)
            src.queue.put_nowait(b"x")

    feeder = asyncio.ensure_future(feed())
    for _ in range(5):  # every chunk within 0.05 s of the last: never a timeout
        assert await timer.wait(src.readany(), now() + 0.05) == b"x"  # type: ignore[arg-type]
    await feeder
    timer.close()


async def test_an_outside_cancellation_is_not_turned_into_a_timeout() -> None:
    src = Source()

    async def reader() -> Any:
        timer = LazyTimeout()
        try:
            return await timer.wait(src.readany(), math.inf)  # type: ignore[arg-type]
        finally:
            timer.close()

    task = asyncio.ensure_future(reader())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
