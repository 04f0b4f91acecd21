"""The fake's scheduler: the batch limit with its FIFO wait, the prefill lane, background load.

What vLLM does: at most ``max_num_seqs`` requests run in a batch; the rest wait in arrival order
(``vllm:num_requests_waiting``), and each running request holds its place until it finishes.
Prefill compute is one resource per engine (the GPU), so prefill time adds up across requests:
a cache hit is faster for everyone behind it too.

How the fake does it:

* ``Scheduler.acquire`` / ``release`` are a FIFO semaphore of ``max_num_seqs`` slots (0: no limit,
  every request runs at once, as before the models existed). A waiter that is cancelled leaves the
  queue; one cancelled after being granted gives its slot back, so slots never leak.
* ``prefill`` reserves ``seconds`` on one lane (``free_at``): a prefill starts when the previous one
  ends, and the caller sleeps until its own end.
* ``Background`` runs N closed-loop requests "for someone else" (another replica's traffic): each
  takes a slot through the same FIFO, holds it ``hold_s``, and queues again at the back. They count
  in running and waiting exactly like real requests, and real requests queue among them.

Invariant: ``running`` is the number of slots held (≤ ``max_num_seqs`` when it is set) and
``waiting`` the number of live waiters in the queue; both are what ``/metrics`` reports. A leaf:
only asyncio, no engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class Scheduler:
    """Batch slots in FIFO order and the engine's single prefill lane."""

    __slots__ = ("max_num_seqs", "running", "running_blocks", "_queue", "free_at")

    def __init__(self, max_num_seqs: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.running = 0
        # KV blocks of running requests' prompts that carry no hash (the prefix cache's pool
        # counts the hashed ones, each once however many requests share it).
        self.running_blocks = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        self.free_at = 0.0

    @property
    def waiting(self) -> int:
        """Live waiters in the queue: what ``vllm:num_requests_waiting`` reports."""
        return sum(1 for f in self._queue if not f.done())

    def _has_room(self) -> bool:
        return not self.max_num_seqs or self.running < self.max_num_seqs

    async def acquire(self) -> None:
        """Take a batch slot, waiting behind earlier arrivals when the batch is full."""
        if self._has_room() and not self._queue:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted, then cancelled before it ran: hand the slot on
            else:
                self._drop(fut)
            raise

    def _drop(self, fut: asyncio.Future[None]) -> None:
        try:
            self._queue.remove(fut)
        except ValueError:
            pass

    def release(self) -> None:
        """Give back a slot :meth:`acquire` granted and hand it to the next live waiter."""
        self.running -= 1
        self._grant()

    def _grant(self) -> None:
        while self._queue and self._has_room():
            fut = self._queue.popleft()
            if fut.done():
                continue
            self.running += 1
            fut.set_result(None)

    def set_limit(self, max_num_seqs: int) -> None:
        """Change ``max_num_seqs`` at run time (0: no limit); waiters the new room admits start now."""
        self.max_num_seqs = max_num_seqs
        self._grant()

    async def prefill(self, seconds: float) -> None:
        """Spend ``seconds`` of the engine's prefill compute, after the prefills already booked."""
        now = time.monotonic()
        end = max(now, self.free_at) + seconds
        self.free_at = end
        await asyncio.sleep(end - now)


class Background:
    """N requests served for someone else, each ``hold_s`` (> 0) long, re-queued when done."""

    __slots__ = ("scheduler", "requests", "hold_s", "served", "_tasks")

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.requests = 0
        self.hold_s = 0.0
        self.served = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def set(self, requests: int, hold_s: float) -> None:
        """Run ``requests`` background requests from now on (0: none); replaces the last setting.

        Returns once the old ones are gone, so a reading taken after it sees only the new load.
        """
        await self.stop()
        self.requests = requests
        self.hold_s = hold_s
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._one()) for _ in range(requests)]

    async def stop(self) -> None:
        """Cancel every background request and wait until each gave its slot back."""
        tasks, self._tasks = self._tasks, []
        self.requests = 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self) -> None:
        sched = self.scheduler
        while True:
            await sched.acquire()
            try:
                await asyncio.sleep(self.hold_s)
            finally:
                sched.release()
            self.served += 1
