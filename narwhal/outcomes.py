"""Where the outcome of every leg is reported: the one place breakers will learn from.

Workers report; the supervisor (next issue) merges the reports into failure streaks in order
of completion time. Until then :class:`Outcomes` records metrics only. Blame rules (SPEC §6)
belong to the supervisor, so a report carries everything it needs: the engine, the leg, the
reason and the partner engine of a crossed attempt.
"""

from __future__ import annotations

from narwhal import metrics
from narwhal.errors import EngineError


class Outcomes:
    def failure(self, error: EngineError, *, partner: str | None) -> None:
        """An engine fault on one leg. 4xx answers and client-side events are not faults."""
        if not error.counts:
            return
        metrics.ENGINE_FAILURES.labels(error.engine, error.phase, error.reason).inc()

    def success(self, producer: str, consumer: str) -> None:
        """An attempt decoded to completion: both the handoff and the stream are proven."""
