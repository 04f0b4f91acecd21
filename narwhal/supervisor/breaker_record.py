"""One engine's breaker: its record and the moves of its state machine (docs/behaviour.md "Recovery"). Pure.

State machine (one per engine)::

    ADMITTED/DEGRADED --charged failure, quarantine_s > 0--> QUARANTINED
    QUARANTINED --tick at the deadline--> ADMITTED, or DEGRADED while a streak >= eject_after
    ADMITTED/QUARANTINED/DEGRADED --a streak reaches eject_after, the cap allows--> EJECTED
    ADMITTED --a streak reaches eject_after, max_ejected_fraction forbids, no quarantine--> DEGRADED
    DEGRADED --success resets the streak--> ADMITTED
    EJECTED --due_probes at next_probe_at--> PROBING --"fail"/"inconclusive"--> EJECTED
    PROBING --"pass"--> ADMITTED, or EJECTED *waiting for its wave* (whole-wave restart)
    waiting --every wave member passed, or wave_hold_s since the first pass--> ADMITTED
    any --operator eject--> EJECTED (not probed);  any --drain--> DRAINING;  any --readmit--> ADMITTED

Streaks are kept per role (``failure_streak`` shows the larger; either reaching ``eject_after``
ejects); a passed probe resets both, a success what it proved (the table in ``fleet.blame``).

Invariants (:meth:`BreakerRecord.check`, run by the breakers on every record a call touched):

* ``quarantined_until`` is set exactly when the state is QUARANTINED;
* ADMITTED means every streak is below ``eject_after``; DEGRADED means one is not;
* a probe is scheduled (``next_probe_at``) only for an engine that is EJECTED or PROBING, was
  ejected by the breaker (not by the operator) and is not waiting for its wave;
* an engine waiting for its wave is EJECTED and has a wave;
* the handoff streak is part of the producer streak.

Why a module of its own: each move here is one engine's, decided from its record and the
settings alone. What needs the fleet — who a failure is charged to (``fleet.blame``), whether
the ejection cap allows one more, a wave's hold, the version the supervisor publishes by — is
:class:`~narwhal.supervisor.breaker.Breakers`'s, which calls these and marks what it touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from narwhal.fleet.blame import EngineInfo, EngineStatus, RoleName, State

OUT = (State.EJECTED, State.PROBING)
SERVING = (State.ADMITTED, State.DEGRADED)


@dataclass
class BreakerRecord:
    """One engine's breaker state (changed by :class:`~narwhal.supervisor.breaker.Breakers` only)."""

    info: EngineInfo
    state: State = State.ADMITTED
    streak: dict[RoleName, int] = field(default_factory=lambda: {"producer": 0, "consumer": 0})
    # Of the producer streak, the handoff charges (``Charge.handoff``): what a same-worker
    # success leaves standing; only a crossed success clears them.
    handoff_streak: int = 0
    ejections: int = 0
    quarantined_until: float | None = None
    last_failure_reason: str | None = None
    last_failure_at: float | None = None
    original_producer: str | None = None  # of the last charged failure, when it was crossed
    by_operator: bool = False
    next_probe_at: float | None = None
    waiting: bool = False  # passed readmission, held for its wave
    joining: bool = False  # discovered at run time, not yet through its first checks (supervisor.membership)
    # When it last came back: evidence gathered before then (a health check sent while it was
    # out and answered after) is stale and charges nothing.
    readmitted_at: float = float("-inf")

    def over(self, eject_after: int) -> bool:
        """Has a role's streak reached ``eject_after``?"""
        return max(self.streak.values()) >= eject_after

    def clear_streaks(self) -> None:
        """Both role streaks and the handoff streak to zero: a readmission, or a take-over's fresh start."""
        self.streak = {"producer": 0, "consumer": 0}
        self.handoff_streak = 0

    def lower_streak(self, role: RoleName, to: int) -> bool:
        """The role's streak down to ``to`` (its handoff charges with it); whether it moved."""
        if self.streak[role] <= to:
            return False
        self.streak[role] = to
        if role == "producer":
            self.handoff_streak = min(self.handoff_streak, to)
        return True

    def recover(self, eject_after: int) -> None:
        """A DEGRADED engine whose streaks fell below ``eject_after`` is ADMITTED again."""
        if self.state is State.DEGRADED and not self.over(eject_after):
            self.state = State.ADMITTED

    def charge(self, roles: Sequence[RoleName], now: float, reason: str | None, original: str | None,
               handoff: bool) -> None:
        """A failure counted against ``roles``: the streaks and the last failure move (what the
        state becomes is the caller's: the ejection cap is the fleet's)."""
        for role in roles:
            self.streak[role] += 1
        if handoff:
            self.handoff_streak += 1
        self.last_failure_reason, self.last_failure_at = reason, now
        self.original_producer = original

    def quarantine(self, until: float) -> None:
        """QUARANTINED until ``until``, or later if it already was."""
        self.state = State.QUARANTINED
        self.quarantined_until = until if self.quarantined_until is None else max(until, self.quarantined_until)

    def end_quarantine(self, eject_after: int) -> None:
        """The quarantine is over: ADMITTED, or DEGRADED while a streak is over."""
        self.quarantined_until = None
        self.state = State.DEGRADED if self.over(eject_after) else State.ADMITTED

    def eject(self, next_probe_at: float | None, *, by_operator: bool) -> None:
        """EJECTED, one ejection more; probed at ``next_probe_at`` (None: the operator's, never probed)."""
        self.state = State.EJECTED
        self.ejections += 1
        self.quarantined_until = None
        self.by_operator = by_operator
        self.waiting = False
        self.next_probe_at = next_probe_at

    def readmit(self, now: float) -> None:
        """Back in service: streaks, quarantine, probes and wave hold cleared."""
        self.state, self.readmitted_at = State.ADMITTED, now
        self.clear_streaks()
        self.quarantined_until = self.next_probe_at = self.original_producer = None
        self.by_operator = self.waiting = False

    def drain(self) -> None:
        """DRAINING: no new requests, never quarantined, ejected or probed until readmitted."""
        self.state = State.DRAINING
        self.quarantined_until = self.next_probe_at = None
        self.waiting = self.by_operator = False

    def take_over(self, status: EngineStatus) -> None:
        """What a previous supervisor published, as this record's: the streak in every role,
        none of it a handoff charge (those are lost with the old process); no probe, no hold."""
        self.clear_streaks()
        for role in self.info.roles:
            self.streak[role] = status.failure_streak
        self.ejections, self.original_producer = status.ejections, None
        self.last_failure_reason, self.last_failure_at = status.last_failure_reason, status.last_failure_at
        self.state, self.quarantined_until, self.next_probe_at = status.state, status.quarantined_until, None
        self.by_operator = self.waiting = False

    def status(self) -> EngineStatus:
        """The record as published: the larger role streak is the failure streak."""
        return EngineStatus(
            name=self.info.name,
            state=self.state,
            failure_streak=max(self.streak.values()),
            ejections=self.ejections,
            quarantined_until=self.quarantined_until,
            last_failure_reason=self.last_failure_reason,
            last_failure_at=self.last_failure_at,
        )

    def check(self, eject_after: int) -> None:
        """The invariants (the module's opening text); an ``AssertionError`` names the record."""
        assert (self.quarantined_until is not None) == (self.state is State.QUARANTINED), self
        assert self.state not in SERVING or self.over(eject_after) == (self.state is State.DEGRADED), self
        assert self.next_probe_at is None or (self.state in OUT and not self.by_operator and not self.waiting), self
        assert not self.waiting or (self.state is State.EJECTED and self.info.wave is not None), self
        assert 0 <= self.handoff_streak <= self.streak["producer"], self
