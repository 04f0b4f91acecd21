"""Where the outcome of every attempt is reported: the one place breakers learn from.

Workers report; the supervisor merges the reports into failure streaks in order of
completion time and applies the blame rules of SPEC §6 (so an ambiguous crossed-decode fault
is not charged here). What a worker does at once, without waiting for the supervisor, is
quarantine an engine a failure is unambiguously charged to (SPEC §5).
"""

from __future__ import annotations

from typing import Protocol

from narwhal import metrics
from narwhal.errors import EngineError
from narwhal.fleet import Engine, Fleet


class Reporter(Protocol):
    """Where attempts are reported: the worker's ring (``shm.worker``), or nowhere (``shm.local``).

    A report is the pair and, for a failure, the error itself (its phase, reason and whether it
    counts) with the engine it names: what a report carries is decided by the error, once.
    """

    def report(
        self, producer: Engine, consumer: Engine, *, error: EngineError | None = None,
        failed: Engine | None = None, before_first_token: bool = False,
    ) -> None: ...

    def quarantine(self, engine: Engine, seconds: float) -> None: ...


class Outcomes:
    def __init__(self, fleet: Fleet, reporter: Reporter, quarantine_s: float) -> None:
        self.fleet = fleet
        self.reporter = reporter
        self.quarantine_s = quarantine_s

    def success(self, producer: Engine, consumer: Engine) -> None:
        """An attempt decoded to completion: both the handoff and the stream are proven."""
        self.reporter.report(producer, consumer)

    def failure(self, producer: Engine, consumer: Engine, error: EngineError, *, before_first_token: bool) -> None:
        failed = self.fleet.by_name.get(error.engine)
        if error.counts:
            metrics.ENGINE_FAILURES.labels(error.engine, error.phase, error.reason).inc()
        self.reporter.report(producer, consumer, error=error, failed=failed, before_first_token=before_first_token)
        if not error.counts or failed is None or self.quarantine_s <= 0:
            return
        ambiguous = error.phase == "decode" and before_first_token and producer is not consumer
        if not ambiguous:
            self.reporter.quarantine(failed, self.quarantine_s)
