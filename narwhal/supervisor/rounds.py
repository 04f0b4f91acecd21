"""A round of per-engine checks, started a batch at a time: no pass of the loop runs all of it.

Invariant: one pass of the supervisor's loop (``supervisor.loop.Loop.step``, which calls
:meth:`Rounds.run`) starts at most :data:`BATCH` checks of a round, whatever the fleet's size,
unless the round has more batches than there are passes in the time it is to be started
within; then as few more per pass as fit it in that time. So the loop's own work — its
heartbeat, the merge of the workers' reports — comes round between batches.

Why: the heartbeat shares one event loop with the rounds of engine reads (``/metrics`` every
``placement.load_interval_s``, ``/health`` every ``recovery.health_interval_s``). Started all
at once, a round's first steps ran back to back in one pass, and its answers, arriving together,
in the next: the longest gap between beats grew with the fleet (perf/RESULTS.md "Figures behind
the code's choices") and with the host's contention (the master took a supervisor of 32 engines
for wedged). Batched and spread over
part of the round's period, the work of one pass is bounded by the batch, and the engines'
answers come spread too.

Why on the loop's passes, not a task sleeping between batches: each sleep woke the process
once more between passes, and each wake-up of an otherwise idle process is paid in full (a task
step, a timer, cold caches), measurably so at 32 engines (perf/RESULTS.md "Figures behind the
code's choices"). The passes happen anyway.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

BATCH = 8  # checks started per pass of the loop: a pass's work stays bounded (perf/RESULTS.md)


class Rounds:
    """The rounds under way: each a queue of batches, the next batch of each started by every :meth:`run`."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s  # between two passes of the loop, the calls of run
        self._rounds: list[deque[Sequence[Callable[[], object]]]] = []

    def spread(self, starts: Sequence[Callable[[], object]], within_s: float) -> None:
        """Queue a round: every ``starts[i]()`` is called by the passes of the next ``within_s``
        seconds, :data:`BATCH` a pass (more only when that would not fit), the first at the next
        :meth:`run`; each start must only start its check (a task)."""
        if not starts:
            return
        passes = max(1, int(within_s / self.period_s))
        batches = math.ceil(len(starts) / BATCH)
        size = BATCH * math.ceil(batches / passes)
        self._rounds.append(deque(starts[first : first + size] for first in range(0, len(starts), size)))

    @property
    def under_way(self) -> bool:
        """Is some round's batch still to be started?"""
        return bool(self._rounds)

    def run(self) -> None:
        """One pass's share: the next batch of every round under way."""
        if not self._rounds:
            return
        for batches in self._rounds:
            for start in batches.popleft():
                start()
        self._rounds = [batches for batches in self._rounds if batches]
