"""The way back for an ejected engine (docs/behaviour.md "Recovery"): the probe schedule and whole-wave restart.

Split from :mod:`narwhal.supervisor.breaker`, which owns every transition and calls these; the
same rules as there hold here: pure, no I/O, no clock (``now`` is an argument), and nothing
here bumps the breakers' version or skips their invariant check (the breaker marks what a call
touched and checks it after).

* **Probe schedule**: after the n-th ejection an engine is probed every
  ``readmit_interval_s × 2^(n−1)`` seconds, capped at ``readmit_interval_max_s``
  (:func:`probe_interval`); a consumer probed after a crossed-decode failure is probed with its
  original producer (:func:`probe_plan`).
* **Whole-wave restart** (:class:`Wave`): an engine that passes while every other member of
  its wave is out, or while another member already waits, is *held*: shown EJECTED, waiting,
  never probed again. The held members come back together once no member is still out
  unproven (every one passed, or was readmitted or drained by the operator), or
  ``wave_hold_s`` after the first pass of the episode. ``wave_hold_s = 0`` releases at once.

Invariant kept here: a held member has no probe scheduled and its wave has a ``hold_since``
(:meth:`Wave.hold`); a wave with nobody held has none (:meth:`Wave.release`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from narwhal.fleet.blame import EngineInfo, EngineStatus, ProbePlan, RoleName, State
from narwhal.settings import RecoverySettings

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


def probe_interval(settings: RecoverySettings, ejections: int) -> float:
    """Seconds between probes after the n-th ejection: readmit_interval_s × 2^(n−1), capped."""
    s = settings
    return min(s.readmit_interval_s * 2.0 ** min(max(ejections, 1) - 1, 64), s.readmit_interval_max_s)


def probe_plan(rec: BreakerRecord, kind: str) -> ProbePlan:
    """What to probe ``rec`` with: its roles, and its original producer for a crossed decode."""
    as_consumer = "consumer" in rec.info.roles
    producer = rec.original_producer if kind == "probe" and as_consumer else None
    return ProbePlan(rec.info.name, kind, "producer" in rec.info.roles, as_consumer, producer)


@dataclass
class Wave:
    """The engines of one ``wave``, readmitted together (whole-wave restart), and its current hold."""

    members: list[BreakerRecord]
    hold_since: float | None = None  # when the first member of this episode passed

    def must_wait(self, rec: BreakerRecord) -> bool:
        """Whether ``rec``, which just passed, is held: another member waits, or all others are out."""
        return any(m.waiting for m in self.members) or all(m.state in OUT for m in self.members if m is not rec)

    def hold(self, rec: BreakerRecord, now: float) -> None:
        """Hold ``rec`` for its wave (shown EJECTED, not probed); the hold starts at the first."""
        rec.state = State.EJECTED
        rec.waiting = True
        rec.next_probe_at = None
        if self.hold_since is None:
            self.hold_since = now

    def release(self, now: float, hold_s: float) -> list[BreakerRecord]:
        """The held members to readmit now: all of them once none is out unproven, or at the hold."""
        waiting = [m for m in self.members if m.waiting]
        if not waiting or self.hold_since is None:
            self.hold_since = None
            return []
        blocked = any(m.state in OUT and not m.waiting for m in self.members)
        if not blocked or now >= self.hold_since + hold_s:
            self.hold_since = None
            return waiting
        return []


def earliest(records: Iterable[BreakerRecord], waves: Iterable[Wave], settings: RecoverySettings) -> float:
    """The first time a tick or a probe could act without a report: a quarantine's end, a
    probe due, a wave hold's end (``inf``: none). Before it, looking at every engine finds nothing."""
    due = [rec.quarantined_until for rec in records if rec.quarantined_until is not None]
    due += [rec.next_probe_at for rec in records if rec.next_probe_at is not None]
    due += [w.hold_since + settings.wave_hold_s for w in waves if w.hold_since is not None]
    return min(due, default=float("inf"))
