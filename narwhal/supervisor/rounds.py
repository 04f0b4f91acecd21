"""A round of per-engine checks, started a batch at a time: no pass of the loop runs all of it.

Invariant: one pass of the supervisor's event loop runs the first steps of at most
:data:`BATCH` checks of a round, whatever the fleet's size, so the loop's own timer — its
heartbeat, the merge of the workers' reports — comes round between batches.

Why: the heartbeat shares one event loop with the rounds of engine reads (``/metrics`` every
``placement.load_interval_s``, ``/health`` every ``recovery.health_interval_s``). Started all
at once, a round's first steps ran back to back in one pass, and its answers, arriving together,
in the next: the longest gap between beats grew with the fleet, by about half a millisecond of
CPU per engine per round on an idle 2-core host, and by the host's contention on a busy one
(issue 25: the master took a supervisor of 32 engines for wedged). Batched and spread over
part of the round's period, the work of one pass is bounded by the batch, and the engines'
answers come spread too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

BATCH = 8  # checks started per pass of the loop: ~4 ms of CPU for the heaviest read measured


async def spread(starts: Sequence[Callable[[], object]], within_s: float) -> None:
    """Call every ``starts[i]()``, :data:`BATCH` at a time, the batches spread evenly over
    ``within_s`` seconds (the first at once); each start must only start its check (a task)."""
    batches = (len(starts) + BATCH - 1) // BATCH
    pause = within_s / batches if batches > 1 else 0.0
    for first in range(0, len(starts), BATCH):
        if first:
            await asyncio.sleep(pause)
        for start in starts[first : first + BATCH]:
            start()
