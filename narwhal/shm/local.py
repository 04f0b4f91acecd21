"""The worker-state interface without shared memory: one process on its own.

Used when the app runs outside gunicorn (in-process tests, embedding) and when a worker
finds no free slot in the shared layout: counts, caps, quarantine and the retry budget
then hold for this process only, and no supervisor hears its outcomes. Operator actions
(``out``) take an engine out; quarantine only steers placement away from it, as in a worker.
"""

from __future__ import annotations

import time

from narwhal import metrics
from narwhal.errors import EngineError
from narwhal.fleet import Engine, Fleet
from narwhal.fleet.placement import LocalInflight


class Quarantine(dict[int, float]):
    """This process's quarantine at once (docs/behaviour.md "Recovery"): engine index -> monotonic deadline.

    Shared by :class:`LocalFleetState` and the worker's view (``shm.worker``), which both put an
    engine here the moment a failure is charged to it, before any supervisor hears of it. A
    dict, so the hot path's ``if table:`` stays a C-level check; entries go lazily, when
    :meth:`holds` finds them over (until then ``any_avoided`` may say yes once too often,
    which costs placement a second look and nothing else).
    """

    def holds(self, index: int) -> bool:
        """Is engine ``index`` quarantined now? Drops the entry once it is over."""
        until = self.get(index)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self[index]
        return False

    def left(self, index: int) -> float:
        """Seconds until engine ``index``'s quarantine ends; 0.0 when it has none."""
        until = self.get(index)
        return 0.0 if until is None else max(until - time.monotonic(), 0.0)

    def add(self, index: int, seconds: float) -> None:
        """Quarantine engine ``index`` for ``seconds`` from now, replacing any earlier deadline."""
        self[index] = time.monotonic() + seconds


# How long a worker avoids an engine it just failed to connect to, on its own word: the
# supervisor publishes the fleet's view within a loop (~20 ms) and a control read or a success
# clears it there; this only bridges that gap, and lapses so a stale mark never outlives it.
UNREACHABLE_HOLD_S = 1.0


class LocalFleetState(LocalInflight):
    """``FleetView``, counts and retry budget for one process alone: no supervisor, no other worker."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(len(fleet.engines))
        self.fleet = fleet
        self.out: set[int] = set()  # engines taken out by an operator action
        self._quarantine = Quarantine()
        self._unreachable = Quarantine()  # engines this process failed to connect to, a moment ago
        self._requests = 0
        self._bounded = {"retries": 0, "migrations": 0}  # retries and migrated streams in flight

    def admitted(self, engine: Engine) -> bool:
        """Neither taken out by an operator nor quarantined (``FleetView``)."""
        if engine.index in self.out:
            return False
        if self._unreachable and self._unreachable.holds(engine.index):
            return False
        return not (self._quarantine and self._quarantine.holds(engine.index))

    # Quarantine is soft (narwhal.fleet.roster.FleetView): a quarantined engine stays placeable.
    def placeable(self, engine: Engine) -> bool:
        """Not taken out by an operator (``FleetView``)."""
        return engine.index not in self.out

    def any_avoided(self) -> bool:
        """Might some engine be quarantined or unreachable (``FleetView``)?"""
        return bool(self._quarantine) or bool(self._unreachable)  # expired entries go lazily

    def unreachable(self, engine: Engine) -> bool:
        """Did this process fail to connect to the engine a moment ago (``FleetView``)?"""
        return bool(self._unreachable) and self._unreachable.holds(engine.index)

    def ejected_by_breaker(self, engine: Engine) -> bool:
        """No breaker runs in one process alone: never (``FleetView``)."""
        return False

    def why_out(self, engine: Engine) -> str:
        """Only an operator takes an engine out here (``FleetView``)."""
        return "taken out by the operator"

    def mark_unreachable(self, engine: Engine) -> None:
        """A connection to ``engine`` failed here: avoided for :data:`UNREACHABLE_HOLD_S`."""
        self._unreachable.add(engine.index, UNREACHABLE_HOLD_S)

    def quarantine_left(self, engine: Engine) -> float:
        """Seconds left of the engine's quarantine (``FleetView``)."""
        return self._quarantine.left(engine.index)

    def quarantine(self, engine: Engine, seconds: float) -> None:
        """Quarantine ``engine`` in this process for ``seconds``."""
        self._quarantine.add(engine.index, seconds)

    def request_started(self) -> None:
        """One more request in flight: the retry budget's base."""
        self._requests += 1

    def request_finished(self) -> None:
        """Pairs with :meth:`request_started`, once per request."""
        self._requests -= 1

    def try_start_retry(self, ratio: float, minimum: int) -> bool:
        """Mark a request retrying if this process's budget allows (``ratio`` of requests, at least ``minimum``)."""
        return self._start("retries", ratio, minimum)

    def retry_finished(self) -> None:
        """The request :meth:`try_start_retry` marked has ended: its share of the budget is free."""
        self._bounded["retries"] -= 1

    def try_start_migration(self, ratio: float, minimum: int) -> bool:
        """Mark a stream migrating if this process's bound allows (``ratio`` of requests, at least ``minimum``)."""
        return self._start("migrations", ratio, minimum)

    def migration_finished(self) -> None:
        """The stream :meth:`try_start_migration` marked has ended."""
        self._bounded["migrations"] -= 1

    def _start(self, kind: str, ratio: float, minimum: int) -> bool:
        if self._bounded[kind] >= max(minimum, int(ratio * self._requests)):
            return False
        self._bounded[kind] += 1
        return True

    def report(self, producer: Engine, consumer: Engine, *, error: EngineError | None = None, **_: object) -> None:
        """No supervisor listens: outcomes only reach the metrics (a counted fault, against the
        engine it was seen on: no blame runs here)."""
        if error is not None and error.counts:
            metrics.ENGINE_FAILURES.labels(error.engine, error.phase, error.reason).inc()
