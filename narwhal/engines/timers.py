"""Per-chunk timeouts for long streams without a timer per chunk.

``asyncio.timeout_at`` around every upstream read or client write costs a Timeout object and
a TimerHandle (created, then cancelled) per chunk: a measurable share of the relay. Here one
timer per stream is armed lazily: each wait only moves the bound forward, and the timer,
when it fires early, re-arms itself at the current bound. It cancels the task only while one
of *its* waits is pending (a read timer never fires into a client write, nor the reverse); a
cancel that races with completion is taken back, so no data is lost.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class LazyTimeout:
    """One lazily re-armed timer for every wait of a stream; the task that makes it is the one it cancels."""

    __slots__ = ("_loop", "_task", "_handle", "_bound", "_reading", "_fired")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        # Given the loop, no asyncio.get_running_loop(): CPython 3.11 makes a getpid() syscall
        # in every call of it (to notice a fork), and a stream makes this timer per request.
        self._loop = loop = loop or asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._bound = math.inf
        self._reading = False
        self._fired = False

    async def wait(self, awaitable: Awaitable[T], bound: float) -> T:
        """Await ``awaitable``, raising ``TimeoutError`` when ``bound`` (loop time) passes."""
        self._bound = bound
        handle = self._handle
        if bound != math.inf and (handle is None or handle.when() > bound):
            if handle is not None:
                handle.cancel()
            self._handle = self._loop.call_at(bound, self._fire)
        self._reading = True
        try:
            result = await awaitable
        except asyncio.CancelledError:
            self._reading = False
            if self._fired:
                self._fired = False
                if self._task.uncancel() == 0:  # ours alone: a timeout, not a cancellation
                    raise TimeoutError from None
            raise
        self._reading = False
        if self._fired:  # fired as the data arrived: keep the data, take the cancel back
            self._fired = False
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                if self._task.uncancel() > 0:
                    raise
        return result

    def _fire(self) -> None:
        self._handle = None
        if not self._reading or self._bound == math.inf:
            return  # the next read re-arms
        if self._loop.time() >= self._bound:
            self._fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(self._bound, self._fire)

    def close(self) -> None:
        """Cancel the timer; call it when the stream ends."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
