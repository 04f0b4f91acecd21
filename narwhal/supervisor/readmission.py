"""The way back for an ejected engine (docs/behaviour.md "Recovery"): the probe schedule and whole-wave restart.

Split from :mod:`narwhal.supervisor.breaker`, which owns every transition and calls these (one
engine's moves are :mod:`narwhal.supervisor.breaker_record`'s); the
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
from dataclasses import dataclass

from narwhal.fleet.blame import ProbePlan, State
from narwhal.settings import RecoverySettings
from narwhal.supervisor.breaker_record import OUT, BreakerRecord


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
