"""Circuit breakers, quarantine, probes and readmission of engines (docs/behaviour.md "Recovery"): pure state.

The supervisor owns one :class:`Breakers`. It feeds it the workers' reports in completion order
(:meth:`~Breakers.record`), its own health checks (:meth:`~Breakers.health_failed`), probe
results and operator actions, calls :meth:`~Breakers.tick` and :meth:`~Breakers.due_probes` on
its clock, and publishes :meth:`~Breakers.statuses` whenever :attr:`~Breakers.version` moved.
Nothing here does I/O, awaits or reads a clock: every time is an argument (seconds on the
supervisor's monotonic-like clock; converting ``quarantined_until`` / ``last_failure_at`` to
Unix seconds for the admin API is the supervisor's job). Blame — who a failed attempt counts
against — is in :mod:`narwhal.fleet.blame`, with the types that cross this module's boundary
(re-exported here: :class:`State`, :class:`EngineInfo`, :class:`Outcome`, :class:`ProbePlan`,
:class:`EngineStatus`).

One engine's record and the moves of its state machine, with the machine drawn and its
invariants, are :mod:`narwhal.supervisor.breaker_record`; the way back (probe schedule, whole-wave
restart) is :mod:`narwhal.supervisor.readmission`. What is the fleet's, and so here: who a
report charges (through blame, with the ambiguity it remembers), whether the ejection cap allows
one more, the waves, and the version the supervisor publishes by. A health failure counts in
every role of the engine.

Invariants of the fleet, beside each record's (checked on every engine a call touched):

* :attr:`Breakers.version` moves by one exactly when some :class:`EngineStatus` changed;
  :attr:`Breakers.changes` with every change but time's: between two moves a success repeated
  changes nothing; tick and due_probes act only from ``readmission.earliest``'s deadline on.
* ``ejected / engines of that role <= max_ejected_fraction`` after every breaker ejection (the
  operator's are not capped).

Rules decided where the contract is silent (docs/decisions.md):

* Reports about an engine that is out (EJECTED, PROBING) change nothing for it (stale
  evidence: only a probe or the operator readmits). Unknown names in reports are ignored;
  operator actions and queries on unknown names raise :class:`KeyError`.
* A QUARANTINED engine still counts failures and successes; a success does not lift the
  quarantine. A charged failure while quarantined extends the deadline to ``now + q``.
  :meth:`Breakers.admitted` honours the deadline even before :meth:`~Breakers.tick` ran.
* A DEGRADED engine is re-checked for ejection on each later charged failure only (not when
  another engine is readmitted).
* A DRAINING engine counts failures (streak, last failure) but is never quarantined, ejected
  or probed: it stays DRAINING until the operator's ``readmit``.
* Operator ``eject`` counts as an ejection (``ejections`` + 1, so it grows later breaker
  probe intervals) and is *not* probed back: it stays out until ``readmit``.
  ``eject(..., probe=True)`` is the same ejection probed back like a breaker ejection (for an
  engine that failed preflight at start).
* Whole-wave restart: an engine that passes while every other member of its wave is out (or
  while another member already waits) waits, shown as EJECTED (see
  :meth:`Breakers.waiting_for_wave`); the hold and its release, and the probe schedule, are in
  :mod:`narwhal.supervisor.readmission`.
* A probe result for an engine that is not PROBING (the operator acted meanwhile) is ignored.
* ``last_failure_reason`` / ``last_failure_at`` move on charged failures and health failures
  only: a failed probe or a fault only remembered as ambiguous leaves them alone.

Deliberately left out: a timeout for a probe whose result never comes (the supervisor owns
probe tasks and always reports); carrying ambiguity sets and probe schedules across a
supervisor restart (:meth:`Breakers.restore` takes the published statuses only); half-open
trickle admission (docs/behaviour.md "Recovery" readmits on a probe, not on sampled traffic); any decay of streaks
or ambiguity sets with time (only successes, probes and the operator reset them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from narwhal.fleet.blame import EngineInfo, EngineStatus, Outcome, Pending, ProbePlan, RoleName, State, charges, counted
from narwhal.settings import RecoverySettings
from narwhal.supervisor.breaker_record import OUT, SERVING, BreakerRecord
from narwhal.supervisor.readmission import Wave, earliest, probe_interval, probe_plan

__all__ = ["Breakers", "EngineInfo", "EngineStatus", "Outcome", "ProbePlan", "State"]

PROBE_RESULTS = ("pass", "fail", "inconclusive")


@dataclass(frozen=True, slots=True)
class Charged:
    """One failure counted against an engine: whom, in which role, and whose leg failed how
    (the supervisor logs each and counts it in ``narwhal_engine_failures_total``)."""

    engine: str
    role: RoleName
    failed: str  # the engine whose leg failed (the charged one, or its partner)
    phase: str  # "prefill", "decode" or "health"
    reason: str


def never_ejected(engines: Sequence[tuple[str, str]], fraction: float) -> list[str]:
    """One line per role whose engines (``(name, role)``) ``max_ejected_fraction`` can never
    eject (its first ejection would already take more than that share: a role of one below 1,
    of N below 1/N)."""
    lines = []
    for role in ("producer", "consumer"):
        names = [name for name, of in engines if of in (role, "both")]
        if names and 1 / len(names) > fraction:
            lines.append(f"role {role} has {len(names)} engine(s) ({', '.join(names)}): recovery.max_ejected_fraction "
                         f"{fraction:g} never ejects one; a failing one stays degraded, probed once it answers health "
                         f"checks again (1.0 lets the breaker eject it)")
    return lines


class Breakers:
    """Every engine's breaker; the supervisor is the only caller (not thread-safe)."""

    def __init__(self, engines: Sequence[EngineInfo], settings: RecoverySettings, *,
                 has_contract: bool = False) -> None:
        self._settings = settings
        auto = settings.readmission == "auto"
        self._kind = ("probe" if has_contract else "health") if auto else settings.readmission
        self._engines: dict[str, BreakerRecord] = {}
        for info in engines:
            if info.role not in ("producer", "consumer", "both"):
                raise ValueError(f"engine {info.name!r}: unknown role {info.role!r}")
            if info.name in self._engines:
                raise ValueError(f"duplicate engine name {info.name!r}")
            self._engines[info.name] = BreakerRecord(info)
        self._pending = Pending({name: rec.info for name, rec in self._engines.items()})
        self._role_size: dict[RoleName, int] = {"producer": 0, "consumer": 0}
        self._waves: dict[str, Wave] = {}
        for rec in self._engines.values():
            for role in rec.info.roles:
                self._role_size[role] += 1
            if rec.info.wave is not None:
                self._waves.setdefault(rec.info.wave, Wave([])).members.append(rec)
        self._status = {name: rec.status() for name, rec in self._engines.items()}
        self._touched: set[str] = set()
        self.version = 0
        self.changes = 0
        self._quiet_until = float("-inf")  # before this, tick and due_probes have nothing to do
        self.charged: list[Charged] = []  # charges since the supervisor last took them (take_charged)
        self._degraded_probing: set[str] = set()  # DEGRADED engines whose probe is under way
        self._degraded_next: dict[str, float] = {}  # a DEGRADED engine's next probe, not before
        self._cause: dict[str, str] = {}  # what last moved an engine, in a few words (the log's why)

    # ------------------------------------------------------------------------------ reports

    def record(self, outcome: Outcome) -> None:
        """Apply one worker report (in completion order)."""
        if outcome.ok:
            self._succeeded(outcome.consumer, "consumer")
            if outcome.producer != outcome.consumer:
                self._succeeded(outcome.producer, "producer")
            elif not outcome.local:
                self._prefill_proven(outcome.producer)
        elif counted(outcome):
            self.changes += 1  # an ambiguous fault is remembered without touching a status
            for c in charges(outcome, self._pending, self._is_out):
                if self._charge(c.engine, (c.role,), outcome.at, outcome.reason, c.original_producer,
                                handoff=c.handoff):
                    self.charged.append(Charged(c.engine, c.role, outcome.failed_engine or c.engine,
                                                outcome.phase or "decode", outcome.reason or ""))
        self._commit()

    def health_failed(self, engine: str, now: float, reason: str, *, sent_at: float | None = None) -> None:
        """A health check saw 503 or no answer: a failure in every role (stale if sent before readmission)."""
        rec = self._engines.get(engine)
        if rec is not None and (sent_at is None or sent_at >= rec.readmitted_at):
            if self._charge(engine, rec.info.roles, now, reason, None):
                self.charged.append(Charged(engine, rec.info.roles[0], engine, "health", reason))
        self._commit()

    def take_charged(self) -> list[Charged]:
        """The charges made since the last call, in order (the supervisor logs and counts them)."""
        charged, self.charged = self.charged, []
        return charged

    # --------------------------------------------------------------------------- the clock

    def tick(self, now: float) -> None:
        """End the quarantines and wave holds that are over; before the earliest deadline, nothing to look at."""
        if now < self._quiet_until:
            return
        for rec in self._engines.values():
            if rec.state is State.QUARANTINED and rec.quarantined_until is not None and rec.quarantined_until <= now:
                self._touched.add(rec.info.name)
                self._cause[rec.info.name] = "quarantine over"
                rec.end_quarantine(self._settings.eject_after)
        for wave in self._waves.values():
            self._settle(wave, now)
        self._commit()
        self._quiet_until = earliest(self._engines.values(), self._waves.values(), self._settings)

    def due_probes(self, now: float) -> list[ProbePlan]:
        """Plans for the ejected engines whose probe is due; they are PROBING from now on."""
        if now < self._quiet_until:
            return []
        plans: list[ProbePlan] = []
        for name, rec in self._engines.items():
            if rec.state is State.EJECTED and rec.next_probe_at is not None and rec.next_probe_at <= now:
                self._touched.add(name)
                rec.state = State.PROBING
                plans.append(probe_plan(rec, self._kind))
        self._commit()
        self._quiet_until = earliest(self._engines.values(), self._waves.values(), self._settings)
        return plans

    def degraded_probe(self, engine: str, now: float) -> ProbePlan | None:
        """A DEGRADED engine (kept serving by ``max_ejected_fraction``) that answers its health
        check again gets the probe an ejected one would, paced like the first readmission probe
        (``readmit_interval_s``): a pass clears its streaks, so no client request is the test."""
        rec = self._engines.get(engine)
        if rec is None or rec.state is not State.DEGRADED or engine in self._degraded_probing \
                or now < self._degraded_next.get(engine, float("-inf")):
            return None
        self._degraded_probing.add(engine)
        self._degraded_next[engine] = now + self.probe_interval(1)
        return probe_plan(rec, self._kind)

    def probe_result(self, engine: str, result: str, now: float) -> None:
        """``"pass"`` readmits (subject to whole-wave restart); anything else keeps the interval.
        A DEGRADED engine's probe (:meth:`degraded_probe`) that passes clears its streaks."""
        if result not in PROBE_RESULTS:
            raise ValueError(f"probe result must be one of {PROBE_RESULTS}, not {result!r}")
        rec = self._engines.get(engine)
        if engine in self._degraded_probing:
            self._degraded_probing.discard(engine)
            if rec is not None and rec.state is State.DEGRADED and result == "pass":
                self._touched.add(engine)
                self._readmit(rec, now, "a probe passed: streak cleared")
                self._commit()
            return
        if rec is None or rec.state is not State.PROBING:
            return  # the operator acted meanwhile, or the engine is gone
        self._touched.add(engine)
        if result != "pass":
            rec.state = State.EJECTED
            rec.next_probe_at = now + self.probe_interval(rec.ejections)
            self._cause[engine] = f"readmission probe: {result}; next in {self.probe_interval(rec.ejections):g}s"
        else:
            wave = self._wave_of(rec)
            if wave is not None and wave.must_wait(rec):
                wave.hold(rec, now)
            else:
                self._readmit(rec, now, "readmission probe passed")
            if wave is not None:
                self._settle(wave, now)
        self._commit()

    # --------------------------------------------------------------------- operator actions

    def eject(self, engine: str, now: float, *, probe: bool = False) -> None:
        """Take the engine out now, whatever ``max_ejected_fraction`` and waves say: until :meth:`readmit`,
        or, with ``probe``, probed back like a breaker ejection (an engine that failed preflight at start)."""
        rec = self._engines[engine]
        self._touched.add(engine)
        if rec.state not in OUT:
            self._eject(rec, now, by_operator=not probe)
        elif not probe:
            rec.state, rec.by_operator, rec.waiting, rec.next_probe_at = State.EJECTED, True, False, None
        elif rec.by_operator:
            rec.by_operator = False
            rec.next_probe_at = now + self.probe_interval(rec.ejections)
        self._settle_wave_of(rec, now)
        self._commit()

    def readmit(self, engine: str, now: float, by: str = "the operator") -> None:
        """Back in service now: streaks, quarantine, probes and wave hold cleared (``by``: who, for the log)."""
        rec = self._engines[engine]
        self._readmit(rec, now, f"readmitted by {by}")
        self._settle_wave_of(rec, now)
        self._commit()

    def drain(self, engine: str, now: float, by: str = "the operator") -> None:
        """No new requests (in-flight ones finish); only :meth:`readmit` undoes it (``by``: who, for the log)."""
        rec = self._engines[engine]
        self._touched.add(engine)
        self._cause[engine] = f"drained by {by}"
        rec.drain()
        self._settle_wave_of(rec, now)
        self._commit()

    def restore(self, status: EngineStatus, now: float, *, by_operator: bool = False, waiting: bool = False) -> None:
        """Take over what a previous supervisor published (a restart); unknown names are ignored.

        ``by_operator`` / ``waiting`` say whether an EJECTED engine was the operator's (never
        probed) or waiting for its wave (see :meth:`ejected_by_operator`, :meth:`waiting_for_wave`).
        Lost with the old process: ambiguity sets, original producers, probe schedules and wave
        holds: the streak goes to every role of the engine, an engine that was PROBING is probed
        again at once, an EJECTED one after one interval, and a wave hold restarts at ``now``.
        """
        rec = self._engines.get(status.name)
        if rec is None:
            return
        self._touched.add(status.name)
        self._pending.clear(status.name)
        rec.take_over(status)
        wave = self._wave_of(rec)
        if status.state in OUT:
            rec.state, rec.quarantined_until = State.EJECTED, None
            rec.by_operator = by_operator
            if waiting and not by_operator and wave is not None:
                wave.hold(rec, now)
            elif not by_operator:
                rec.next_probe_at = now + (0.0 if status.state is State.PROBING else self.probe_interval(rec.ejections))
        elif status.state is not State.QUARANTINED or status.quarantined_until is None:
            rec.quarantined_until = None
            if rec.state is not State.DRAINING:
                rec.end_quarantine(self._settings.eject_after)
        self._commit()

    # ------------------------------------------------------------------------------ queries

    def status(self, engine: str) -> EngineStatus:
        """The engine's status as last committed; ``KeyError`` for an unknown name."""
        return self._status[engine]

    def statuses(self) -> list[EngineStatus]:
        """Every engine's status, in fleet order: what the supervisor publishes."""
        return [self._status[name] for name in self._engines]

    def admitted(self, engine: str, now: float) -> bool:
        """Whether the engine takes new requests now."""
        rec = self._engines[engine]
        if rec.state is State.QUARANTINED:
            return rec.quarantined_until is not None and rec.quarantined_until <= now
        return rec.state in SERVING

    def cause(self, engine: str) -> str | None:
        """What last moved the engine back into service, out of a quarantine or a drain, or
        failed its probe, in a few words; None when nothing has yet."""
        return self._cause.get(engine)

    def ejected_by_operator(self, engine: str) -> bool:
        """Ejected by the operator: not probed, out until :meth:`readmit`."""
        rec = self._engines[engine]
        return rec.by_operator and rec.state in OUT

    def waiting_for_wave(self, engine: str) -> bool:
        """Passed readmission but held (shown EJECTED) until its wave comes back together."""
        return self._engines[engine].waiting

    def probe_interval(self, ejections: int) -> float:
        """Seconds between probes after the n-th ejection: readmit_interval_s × 2^(n−1), capped."""
        return probe_interval(self._settings, ejections)

    # ------------------------------------------------------------------------------ helpers

    def _is_out(self, engine: str) -> bool:
        rec = self._engines.get(engine)
        return rec is not None and rec.state in OUT

    def _succeeded(self, engine: str, role: RoleName) -> None:
        rec = self._engines.get(engine)
        if rec is None or rec.state in OUT:
            return
        self._pending.clear(engine, role)
        self._lower_streak(rec, role, 0)

    def _prefill_proven(self, engine: str) -> None:
        """A same-worker success: the engine's prefill works; its handoffs are still unproven."""
        rec = self._engines.get(engine)
        if rec is not None and rec.state not in OUT:
            self._lower_streak(rec, "producer", rec.handoff_streak)

    def _lower_streak(self, rec: BreakerRecord, role: RoleName, to: int) -> None:
        if rec.lower_streak(role, to):
            self._touched.add(rec.info.name)
            self._cause[rec.info.name] = "a request succeeded on it"
            rec.recover(self._settings.eject_after)

    def _charge(
        self, engine: str, roles: Sequence[RoleName], now: float, reason: str | None, original: str | None,
        *, handoff: bool = False,
    ) -> bool:
        """Count a failure against ``engine`` in ``roles``; False when it is out (stale evidence)."""
        rec = self._engines.get(engine)
        if rec is None or rec.state in OUT:
            return False
        self._touched.add(engine)
        self._cause.pop(engine, None)  # the streak says why from here
        rec.charge(roles, now, reason, original, handoff)
        if rec.state is State.DRAINING:
            return True
        over = rec.over(self._settings.eject_after)
        if over and self._may_eject(rec):
            self._eject(rec, now, by_operator=False)
        elif self._settings.failure_quarantine_s > 0:
            rec.quarantine(now + self._settings.failure_quarantine_s)
        elif over:
            rec.state = State.DEGRADED
        return True

    def _may_eject(self, rec: BreakerRecord) -> bool:
        """``ejected / engines of that role ≤ max_ejected_fraction`` afterwards, for every role."""
        for role in rec.info.roles:
            out = sum(1 for r in self._engines.values() if r.state in OUT and role in r.info.roles)
            if (out + 1) / self._role_size[role] > self._settings.max_ejected_fraction:
                return False
        return True

    def _eject(self, rec: BreakerRecord, now: float, *, by_operator: bool) -> None:
        self._touched.add(rec.info.name)
        rec.eject(None if by_operator else now + self.probe_interval(rec.ejections + 1), by_operator=by_operator)

    def _readmit(self, rec: BreakerRecord, now: float, cause: str) -> None:
        self._touched.add(rec.info.name)
        self._cause[rec.info.name] = cause
        rec.readmit(now)
        self._pending.clear(rec.info.name)

    def _wave_of(self, rec: BreakerRecord) -> Wave | None:
        if not self._settings.whole_wave_restart or rec.info.wave is None:
            return None
        return self._waves[rec.info.wave]

    def _settle_wave_of(self, rec: BreakerRecord, now: float) -> None:
        wave = self._wave_of(rec)
        if wave is not None:
            self._settle(wave, now)

    def _settle(self, wave: Wave, now: float) -> None:
        """Readmit the members waiting for their wave once none is out unproven, or at the hold."""
        for member in wave.release(now, self._settings.wave_hold_s):
            self._readmit(member, now, f"its wave {member.info.wave} is back")

    def _moved(self) -> None:
        """Something changed other than time: the next tick looks at every engine again."""
        self.changes += 1
        self._quiet_until = float("-inf")

    def _commit(self) -> None:
        if self._touched:
            self._moved()
        changed = False
        for name in self._touched:
            rec = self._engines[name]
            rec.check(self._settings.eject_after)
            status = rec.status()
            if status != self._status[name]:
                self._status[name] = status
                changed = True
        self._touched.clear()
        if changed:
            self.version += 1
