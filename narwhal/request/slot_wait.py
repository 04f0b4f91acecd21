"""The bounded wait for a free slot, shared by P/D pairs and passthrough engines (docs/behaviour.md "Placement").

The choice itself is pure and lives in ``narwhal.fleet`` (:class:`~narwhal.fleet.placement.Placement`,
:class:`~narwhal.fleet.passthrough.SingleEngine`: reserve now or say no); waiting awaits, so it
lives here, in the layer that awaits. :class:`WaitingPlacement` and :class:`WaitingEngine` add
``reserve`` (now, or after a bounded wait) to those choices.

A request that cannot be placed at once waits up to ``placement.queue_timeout_s`` (never past
its deadline), looking again whenever ``wake`` returns — when a slot of this worker is released
or, at the latest, every ``POLL_S``, since slots freed by other workers wake no waiter here —
and is refused with 503 ``no_engine`` when the time runs out. At most ``placement.max_queue``
requests wait on each :class:`Queue`; ``narwhal_requests_queued`` counts them. One place, so
the pair and the passthrough paths cannot drift apart in what a wait means.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from narwhal.errors import PlacementError
from narwhal.fleet.passthrough import EngineSlot, SingleEngine
from narwhal.fleet.placement import Placement, Reservation
from narwhal.fleet.placement.reservation import PhaseName
from narwhal.fleet.roster import Engine

T = TypeVar("T")

POLL_S = 0.05  # look again at least this often: other workers' releases wake no one here


class Queue:
    """The requests waiting for one kind of slot on this worker."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting = 0

    def refuse_if_full(self, max_queue: int, retry_after_s: int) -> None:
        """Raise ``no_engine`` if ``max_queue`` already wait here: checked before :meth:`wait_for`."""
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


class WaitingPlacement(Placement):
    """A :class:`Placement` whose ``reserve`` waits (bounded) for a pair; a release on this worker
    wakes the waiters at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._freed = asyncio.Event()
        self.queue = Queue()  # requests waiting for a pair on this worker

    async def reserve(
        self, model: str, deadline: float, avoid: frozenset[str] = frozenset(), note: Any = None,
        local: bool = False, exclude: frozenset[str] = frozenset(),
    ) -> Reservation:
        """Wait (bounded) for a pair; raise ``no_engine`` when none frees in time (``note``: the
        policy's, carried unread; ``exclude``: engines never used, as a migration's failed consumers)."""
        found = self._place(model, avoid, note, local, exclude)
        if found is not None:
            return found
        loop = asyncio.get_running_loop()
        retry_after = self.settings.retry_after_s
        self.queue.refuse_if_full(self.settings.max_queue, retry_after)
        if not self.servable(model, local, exclude):
            why = None if local else (self.incompatibility(model) or self.unready(model))
            raise PlacementError(
                f"no engine available for model {model!r}: {why or 'every engine serving it is out'}",
                retry_after_s=retry_after,
            )
        give_up = min(loop.time() + self.settings.queue_timeout_s, deadline)
        return await self.queue.wait_for(
            lambda: self._place(model, avoid, note, local, exclude), self._until_freed, give_up, model, retry_after
        )

    async def _until_freed(self, at_most_s: float) -> None:
        """Until a slot of this worker is released, or ``at_most_s``."""
        try:
            async with asyncio.timeout(at_most_s):
                await self._freed.wait()
        except TimeoutError:
            pass

    def _release(self, engine: Engine, phase: PhaseName) -> None:
        self.inflight.release(engine, phase)
        if self.queue.waiting:  # a fresh Event per release costs, and only waiters need one
            freed, self._freed = self._freed, asyncio.Event()
            freed.set()


class WaitingEngine(SingleEngine):
    """A :class:`SingleEngine` whose ``reserve`` waits (bounded, polled) for a slot."""

    def __init__(self, placement: Placement, rng: random.Random | None = None) -> None:
        super().__init__(placement, rng)
        self.queue = Queue()  # passthrough requests waiting for an engine on this worker

    async def reserve(self, model: str, deadline: float) -> EngineSlot:
        """A slot now, or after a bounded wait; ``no_engine`` when none frees in time."""
        found = self.try_reserve(model)
        if found is not None:
            return found
        settings = self.placement.settings
        retry_after = settings.retry_after_s
        if not any(self.placement.view.placeable(e) for e in self._serving(model)):
            raise PlacementError(
                f"no engine available for model {model!r}: every engine serving it is out", retry_after_s=retry_after
            )
        self.queue.refuse_if_full(settings.max_queue, retry_after)
        give_up = min(asyncio.get_running_loop().time() + settings.queue_timeout_s, deadline)
        # Polled: a passthrough waiter is not among the pair waiters a release wakes.
        return await self.queue.wait_for(lambda: self.try_reserve(model), asyncio.sleep, give_up, model, retry_after)
