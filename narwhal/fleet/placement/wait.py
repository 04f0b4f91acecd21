"""The bounded wait for a free slot, shared by P/D pairs and passthrough engines (SPEC §3 step 2).

A request that cannot be placed at once waits up to ``placement.queue_timeout_s`` (never past
its deadline), looking again whenever ``wake`` returns — when a slot of this worker is released
or, at the latest, every ``POLL_S``, since slots freed by other workers wake no waiter here —
and is refused with 503 ``no_engine`` when the time runs out. At most ``placement.max_queue``
requests wait on each :class:`Queue`; ``narwhal_requests_queued`` counts them. One place, so
the pair and the passthrough paths cannot drift apart in what a wait means.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from narwhal.errors import PlacementError

T = TypeVar("T")

POLL_S = 0.05  # look again at least this often: other workers' releases wake no one here


class Queue:
    """The requests waiting for one kind of slot on this worker."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting = 0

    def refuse_if_full(self, max_queue: int, retry_after_s: int) -> None:
        if self.waiting >= max_queue:
            raise PlacementError("no engine available: the wait queue is full", retry_after_s=retry_after_s)

    async def wait_for(
        self,
        place: Callable[[], T | None],
        wake: Callable[[float], Awaitable[None]],
        give_up: float,
        model: str,
        retry_after_s: int,
    ) -> T:
        """``place()`` once it returns a slot, trying after each ``wake(at most seconds)``;
        ``no_engine`` once ``give_up`` (loop time) passes. The caller has checked
        :meth:`refuse_if_full` (in its own order among its refusals)."""
        # Touched on this slow path only (a request placed at once never waits), and imported
        # here: placement must not pull prometheus_client into the master.
        from narwhal import metrics

        loop = asyncio.get_running_loop()
        self.waiting += 1
        metrics.REQUESTS_QUEUED.inc()
        try:
            while (remaining := give_up - loop.time()) > 0:
                await wake(min(remaining, POLL_S))
                found = place()
                if found is not None:
                    return found
        finally:
            self.waiting -= 1
            metrics.REQUESTS_QUEUED.dec()
        raise PlacementError(
            f"no engine available for model {model!r}: all reservations are in use", retry_after_s=retry_after_s
        )
