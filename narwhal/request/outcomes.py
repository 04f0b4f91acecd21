"""Where the outcome of every attempt is reported: the one place breakers learn from.

Workers report; the supervisor merges the reports into failure streaks in order of
completion time and applies the blame rules of docs/behaviour.md "Recovery" (so an ambiguous crossed-decode fault
is not charged here). What a worker does at once, without waiting for the supervisor, is
quarantine an engine a failure is unambiguously charged to (docs/behaviour.md "Recovery"), and avoid an engine it
could not connect to (docs/behaviour.md "Recovery": unreachable, whoever the fault is charged to).
"""

from __future__ import annotations

from typing import Protocol

from narwhal.errors import EngineError
from narwhal.fleet import Engine, Fleet


class Reporter(Protocol):
    """Where attempts are reported: the worker's ring (``shm.worker``), or nowhere (``shm.local``).

    A report is the pair and, for a failure, the error itself (its phase, reason and whether it
    counts) with the engine it names: what a report carries is decided by the error, once.
    ``local``: a local decode (the pair is the consumer twice), whose success proves nothing
    about the engine as a producer (docs/behaviour.md "Recovery").
    """

    def report(
        self, producer: Engine, consumer: Engine, *, error: EngineError | None = None,
        failed: Engine | None = None, before_first_token: bool = False, local: bool = False,
    ) -> None:
        """Hand one attempt's outcome to the supervisor, which keeps the streaks (docs/behaviour.md
        "Recovery"); never awaits.
        """

    def quarantine(self, engine: Engine, seconds: float) -> None:
        """Keep ``engine`` out of placement for ``seconds`` now, not waiting for the supervisor
        (docs/behaviour.md "Recovery").
        """

    def mark_unreachable(self, engine: Engine) -> None:
        """A connection to ``engine`` just failed: placement avoids it now, not waiting for the supervisor
        (docs/behaviour.md "Recovery").
        """


class Outcomes:
    """Turns each attempt's end into reports, failure counters and quarantines: breakers' one source."""

    def __init__(self, fleet: Fleet, reporter: Reporter, quarantine_s: float) -> None:
        self.fleet = fleet
        self.reporter = reporter
        self.quarantine_s = quarantine_s

    def success(self, producer: Engine, consumer: Engine, *, local: bool = False) -> None:
        """An attempt decoded to completion: the stream is proven, and the handoff if there was
        one (what each kind of success proves is the breaker's: ``narwhal.fleet.blame``)."""
        self.reporter.report(producer, consumer, local=local)

    def failure(
        self, producer: Engine, consumer: Engine, error: EngineError, *, before_first_token: bool, local: bool = False
    ) -> None:
        """Report a failed attempt; quarantine the engine at once if the error counts and blame is clear."""
        failed = self.fleet.by_name.get(error.engine)
        self.reporter.report(producer, consumer, error=error, failed=failed, before_first_token=before_first_token,
                             local=local)
        if failed is not None and error.connect_failed:
            self.reporter.mark_unreachable(failed)  # a fact of the wire, whoever is blamed
        if not error.counts or failed is None or self.quarantine_s <= 0:
            return
        ambiguous = error.phase == "decode" and before_first_token and producer is not consumer
        if not ambiguous:
            self.reporter.quarantine(failed, self.quarantine_s)
