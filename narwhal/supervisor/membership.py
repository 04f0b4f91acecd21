"""Breakers for a fleet whose engines come and go at run time (docs/behaviour.md "Engines that come and go"). Pure,
like the breakers.

:class:`ChangingBreakers` is :class:`~narwhal.supervisor.breaker.Breakers` plus :meth:`~ChangingBreakers.reshape`:
the engines become a new list, each keeping its breaker record (streaks, ejections, quarantine,
probe schedule) while it stays; the permitted pairs every engine's blame is judged by follow the
new list, as do the role sizes ``max_ejected_fraction`` counts and the waves.

A *joining* engine (one discovered while the router runs) starts **PROBING**, out of placement,
and is probed at once with the checks an engine gets at start — lifecycle (``/health``,
``/v1/models``, the version pin) and, with an ``[engine_contract]``, the transfer probe
preflight would make — whatever ``recovery.readmission`` says for readmissions. It stays
PROBING (not EJECTED: it never served) until one passes, probed again every
``recovery.readmit_interval_s`` (its first interval) until then; a pass admits it (subject to its
wave, like any readmission). Operator actions work on it as on any engine.

Why a subclass here rather than more of ``breaker.py``: the state machine stays one module a
reader can hold in mind; membership is a separate question (who is there), asked only when a
discovery source changed.

The decisions discovery makes (``supervisor.discovery``) are this module's vocabulary too:
:class:`Join`, :class:`Drain`, :class:`Readmit`, :class:`Forget`, applied by the supervisor's
loop alone (``Supervisor.apply_membership``). They live here, not beside discovery, because the
loop imports them whether discovery runs or not, and discovery's sources bring dnspython.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from narwhal.fleet.blame import EngineInfo, ProbePlan, State
from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.breaker import Breakers
from narwhal.supervisor.breaker_record import BreakerRecord
from narwhal.supervisor.readmission import Wave, probe_plan

JOIN_KIND_CONTRACT = "probe"  # lifecycle and the transfer probe (supervisor.probes)
JOIN_KIND = "lifecycle"  # without a contract: /health and /v1/models


@dataclass(frozen=True, slots=True)
class Join:
    """A found engine to take up: a spare slot, its descriptor there, PROBING, then LIVE."""

    spec: EngineSpec
    source: str  # where it was found: ``file``, ``dns:NAME``


@dataclass(frozen=True, slots=True)
class Drain:
    """An engine no source names any more: no new legs, the in-flight ones finish."""

    name: str


@dataclass(frozen=True, slots=True)
class Readmit:
    """A draining engine named again: it serves again."""

    name: str


@dataclass(frozen=True, slots=True)
class Forget:
    """A drained engine no worker holds a leg on: its slot retired, its breaker and series gone."""

    name: str


Decision = Join | Drain | Readmit | Forget


class ChangingBreakers(Breakers):
    """Breakers whose engines change at run time (discovery); a joining engine is PROBING."""

    def reshape(self, engines: Sequence[EngineInfo], joining: set[str], now: float) -> None:
        """The engines become ``engines``; those named in ``joining`` that are new start PROBING."""
        wanted = {info.name: info for info in engines}
        for name in [n for n in self._engines if n not in wanted]:
            del self._engines[name]
            del self._status[name]
            self._pending.clear(name)
            self._touched.discard(name)
        for name, info in wanted.items():
            rec = self._engines.get(name)
            if rec is not None:
                rec.info = info
                continue
            rec = self._engines[name] = BreakerRecord(info)
            if name in joining:
                rec.state, rec.joining, rec.next_probe_at = State.PROBING, True, now
            self._status[name] = rec.status()
        self._pending.infos = {name: rec.info for name, rec in self._engines.items()}
        self._role_size = {"producer": 0, "consumer": 0}
        waves: dict[str, Wave] = {}
        for rec in self._engines.values():
            for role in rec.info.roles:
                self._role_size[role] += 1
            if rec.info.wave is not None:
                old = self._waves.get(rec.info.wave)
                waves.setdefault(rec.info.wave, Wave([], None if old is None else old.hold_since)).members.append(rec)
        self._waves = waves
        self.version += 1
        self._moved()  # new engines, new deadlines

    def joining(self, engine: str) -> bool:
        """Is the engine discovered and not yet through its first checks?"""
        rec = self._engines.get(engine)
        return rec is not None and rec.joining

    def due_probes(self, now: float) -> list[ProbePlan]:
        """The joining engines' first checks due now (one in flight each), then the breakers' own probes."""
        if now < self._quiet_until:  # a joining engine's state or probe moves only through _moved
            return []
        plans: list[ProbePlan] = []
        for rec in self._engines.values():
            if rec.joining and rec.state is not State.PROBING:
                rec.joining = False  # admitted, or the operator's: an ordinary engine from now on
            due = rec.next_probe_at is not None and rec.next_probe_at <= now
            if rec.joining and rec.state is State.PROBING and due:
                rec.next_probe_at = None  # a probe in flight: none other until its result
                kind = JOIN_KIND_CONTRACT if self._kind == "probe" else JOIN_KIND
                plans.append(probe_plan(rec, kind))
        return plans + super().due_probes(now)

    def probe_result(self, engine: str, result: str, now: float) -> None:
        """A joining engine that fails stays PROBING and is probed again; anything else as the breakers do."""
        rec = self._engines.get(engine)
        if rec is not None and rec.joining and rec.state is State.PROBING:
            if result != "pass":
                rec.next_probe_at = now + self.probe_interval(0)
                self._moved()
                return  # still PROBING: it never served, so it is not EJECTED
            rec.joining = False
        elif rec is not None and rec.joining:
            rec.joining = False  # the operator acted meanwhile: an ordinary engine from now on
        super().probe_result(engine, result, now)
