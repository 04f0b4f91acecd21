"""The supervisor: the only writer of breaker state, run in its own process.

Its loop, a pass (`Supervisor.step`, which never awaits) every LOOP_S; time is an injected clock,
so a test drives the passes with a fake one (tests/unit/supervisor/test_supervisor_loop.py):

1. beat (the master's keeper reads the heartbeat: a stale one means a wedged loop);
2. read every worker's outcome ring, merge the reports in order of completion time and feed
   them to the breakers (operator actions travel the same rings);
3. let time pass in the breakers (quarantine and wave-hold expiry), start due probes;
4. once any status changed, publish every engine record, then bump the generation, so workers
   re-read the records on their next request: an ejection is visible fleet-wide within one
   loop period (~20 ms) of the report that caused it; the state gauges follow at once.

Less often: health checks of admitted engines, reading their load (``supervisor.load``, every
``placement.load_interval_s``) and their models (``supervisor.models``: at start, at readmission),
sweeping slots of dead workers, exporting the in-flight gauges. A (re)started supervisor takes
the last published records as its starting state, so a restart loses no ejection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from narwhal import metrics
from narwhal.engines.control import PooledReader, open_session
from narwhal.fleet import Engine, Fleet
from narwhal.fleet.reachability import Reachability
from narwhal.settings import Settings
from narwhal.settings.engines import EngineSpec
from narwhal.shm import layout as L
from narwhal.shm.holdings import Holdings, identity
from narwhal.shm.records import (
    RECORD_BY_OPERATOR,
    RECORD_UNREACHABLE,
    RECORD_WAITING_FOR_WAVE,
    EngineRecord,
    RecordBusy,
    Report,
    read_record,
    write_record,
)
from narwhal.shm.shared import SharedFleet, alive
from narwhal.shm.table import record_hash
from narwhal.supervisor.breaker import EngineInfo, EngineStatus, State
from narwhal.supervisor.checks import Checks
from narwhal.supervisor.holdings import HoldingsModel
from narwhal.supervisor.load import LoadReader
from narwhal.supervisor.membership import ChangingBreakers
from narwhal.supervisor.models import ModelReader
from narwhal.supervisor.probes import Prober
from narwhal.supervisor.reports import RingIndexes, Successes, apply_reports
from narwhal.supervisor.rounds import Rounds
from narwhal.supervisor.transitions import log_transitions

if TYPE_CHECKING:  # discovery is imported only when enabled (dnspython)
    from narwhal.supervisor.discovery import Discovery

log = logging.getLogger("narwhal.supervisor")

# Draining engines too: their load shows, and a drained engine restarted for an upgrade is seen
# refusing and answering again, so its new version is read before an operator readmits it.
_LOAD_READ_STATES = frozenset({State.ADMITTED, State.DEGRADED, State.QUARANTINED, State.DRAINING})
# Producers that take no homes: placement sends them no new prefill (fleet.placement.homes).
_NO_HOMES = frozenset({State.EJECTED, State.PROBING, State.DRAINING})
LOOP_S = 0.02  # ejections reach every worker within one loop: ~20 ms, well under docs/behaviour.md "Processes"'s 100 ms
SWEEP_S = 0.25
EXPORT_S = 1.0


@dataclass
class Loop:
    """What the loop's passes carry from one to the next: the checkers and when each is next due."""

    prober: Prober
    loads: LoadReader
    discovery: Discovery | None
    pid: int
    next_health: float
    next_load: float = 0.0
    next_sweep: float = 0.0
    next_export: float = 0.0
    models: ModelReader | None = None  # the engines' /v1/models (run: it reads over the session)


class Supervisor:
    """The supervisor's state and loop: the one writer of breaker, load and holdings records."""

    def __init__(self, shared: SharedFleet, settings: Settings, holdings: Holdings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shared = shared
        self._clock = clock  # every decision's time: a test drives the loop's passes with a fake one
        self.settings = settings
        self.sources: dict[str, str] = {}  # engine name -> its source (static, file, dns:NAME): discovery only
        if settings.discovery.enabled:  # the table's engines, each at its engine slot (worker.roster_follow)
            described = shared.described()
            self.sources = {entry["name"]: source for _, entry, source in described}
            members = [(slot, EngineSpec(**entry)) for slot, entry, _ in described]
            self.fleet = Fleet(settings, members)
        else:
            members = list(enumerate(settings.engines))
            self.fleet = Fleet(settings)
        self.specs = {spec.name: spec for _, spec in members}
        self.breakers = ChangingBreakers(self._infos(), settings.recovery,
                                         has_contract=settings.engine_contract is not None)
        # whose last connection attempt failed (docs/behaviour.md "Recovery"): published as a flag
        self.reach = Reachability()
        self.models: ModelReader | None = None  # set by run(): the engines' /version and /v1/models
        self._map_slots()
        self._outcome_rings = RingIndexes(shared.layout.slot_offset(0) + L.SLOT_RING_WRITE, shared.layout.slot_size)
        self._successes = Successes()
        self._published = (-1, -1)  # the (breakers, reachability) versions last published
        self._states: dict[str, State] = {}  # each engine's state as last published, for the transition lines
        self.checks = Checks(self.fleet, self.breakers, self.reach, clock)  # probes and health checks
        self.rounds = Rounds(LOOP_S)  # health checks, load and model reads: a batch per pass (supervisor.rounds)
        self._wall = time.time() - clock()
        self.holdings = holdings
        # Policy held only: the series exist (at 0) from the start, so a rate() sees the first one.
        self._predictions = {r: metrics.HOLDINGS_PREDICTIONS.labels(r)
                             for r in (("exact", "over", "under") if holdings is not None else ())}
        self.model: HoldingsModel | None = None
        if holdings is not None:
            self.model = HoldingsModel(self._holdings_stamps(), holdings.layout.keys, settings.placement.block_chars,
                                       self.fleet.engines)
            rings = holdings.layout
            self._prefill_rings = RingIndexes(rings.ring_offset(0), rings.ring_offset(1) - rings.ring_offset(0))

    def _holdings_stamps(self) -> list[int | None]:
        """Per section (an engine slot), the stamp of the producer there; None: no producer."""
        assert self.holdings is not None
        stamps: list[int | None] = [None] * self.holdings.layout.sections
        for e in self.fleet.engines:
            if e.can_prefill and e.index < len(stamps):
                stamps[e.index] = identity(e.name, e.url)
        return stamps

    def _infos(self) -> list[EngineInfo]:
        return [EngineInfo(name=e.name, role=e.role, wave=e.wave,
                           permitted_consumers=frozenset(d.name for d in e.permitted_consumers),
                           permitted_producers=frozenset(p.name for p in e.permitted_producers))
                for e in self.fleet.engines]

    def _map_slots(self) -> None:
        # Engine slots (shm.table): what every shared record, count and report is keyed by; the
        # same for an engine across reloads, so old workers' reports land on the engine they used.
        # With discovery an engine's index is its slot (one joining is not LIVE in the table yet).
        slots = {e.name: e.index if self.settings.discovery.enabled else self.shared.engine_slot(e.name, e.url)
                 for e in self.fleet.engines}
        missing = [name for name, slot in slots.items() if slot is None]
        if missing:
            raise RuntimeError(f"engines without a slot in the shared table: {', '.join(missing)}")
        self._slot: dict[str, int] = {name: slot for name, slot in slots.items() if slot is not None}
        self._by_slot: dict[int, Engine] = {self._slot[e.name]: e for e in self.fleet.engines}
        self._span = max(self._slot.values(), default=-1) + 1

    def slot_of(self, engine: Engine) -> int:
        """The engine's slot in the shared table: where its records sit (``shm.table``)."""
        return self._slot[engine.name]

    def set_engines(self, members: list[tuple[int, EngineSpec]], joining: set[str]) -> None:
        """Discovery: the engines become ``members`` (engine slot, entry); those named in
        ``joining`` start PROBING (``supervisor.membership``)."""
        self.fleet.replace(members)
        self.specs = {spec.name: spec for _, spec in members}
        self.breakers.reshape(self._infos(), joining, self._clock())
        if self.model is not None:  # a discovered producer gets its section
            self.model.reshape(self._holdings_stamps(), self.fleet.engines)
        for name in self.reach.names():
            if name not in self.fleet.by_name:  # gone from the fleet: nothing is remembered of it
                self.reach.forget(name)
        self._map_slots()

    # -- state ------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Start from the records a previous supervisor published (none at first start)."""
        now = self._clock()
        for engine in self.fleet.engines:
            try:  # no supervisor is writing now: a record its predecessor left mid-write counts if whole
                rec = read_record(self.shared.region, self.slot_of(engine), writer_gone=True)
            except RecordBusy:
                continue
            if rec is None or rec.name_hash != record_hash(engine.name, engine.url):
                continue
            self.breakers.restore(
                EngineStatus(
                    name=engine.name,
                    state=State(rec.state),
                    failure_streak=rec.failure_streak,
                    ejections=rec.ejections,
                    quarantined_until=None if rec.quarantined_until is None else rec.quarantined_until - self._wall,
                    last_failure_reason=rec.last_failure_reason,
                    last_failure_at=None if rec.last_failure_at is None else rec.last_failure_at - self._wall,
                ),
                now,
                by_operator=bool(rec.flags & RECORD_BY_OPERATOR),
                waiting=bool(rec.flags & RECORD_WAITING_FOR_WAVE),
            )
            self._states[engine.name] = State(rec.state)
            if rec.flags & RECORD_UNREACHABLE:
                self.reach.saw(engine.name, False)
        self.reach.take_changes()  # taken over, not news

    def publish(self) -> None:
        """Every engine's record under the next generation, then the bump: workers re-read once they see it."""
        version = self.shared.generation + 1  # each record carries it: shm.worker waits for it
        for engine in self.fleet.engines:
            st = self.breakers.status(engine.name)
            write_record(self.shared.region, self.slot_of(engine), EngineRecord(
                version=version,
                state=int(st.state),
                failure_streak=st.failure_streak,
                ejections=st.ejections,
                quarantined_until=None if st.quarantined_until is None else st.quarantined_until + self._wall,
                last_failure_reason=st.last_failure_reason,
                last_failure_at=None if st.last_failure_at is None else st.last_failure_at + self._wall,
                name_hash=record_hash(engine.name, engine.url),
                flags=(RECORD_BY_OPERATOR if self.breakers.ejected_by_operator(engine.name) else 0)
                | (RECORD_WAITING_FOR_WAVE if self.breakers.waiting_for_wave(engine.name) else 0)
                | (RECORD_UNREACHABLE if self.reach.unreachable(engine.name) else 0),
            ))
        self.shared.bump_generation()
        self._published = (self.breakers.version, self.reach.version)
        log_transitions(self.fleet.engines, self.breakers, self.reach, self._states, self.settings.recovery)
        if self.model is not None:
            out = set()
            for engine in self.fleet.engines:  # an ejected producer's cache is not to be counted on
                state = self.breakers.status(engine.name).state
                if state == State.EJECTED:
                    self.model.forget(engine.index)
                if state in _NO_HOMES:
                    out.add(engine.index)
            self.model.out = frozenset(out)  # no homes there: placement would not send them
        self.export_states()

    def export_states(self) -> None:
        """Engine states as gauges at every publish: within one loop of ``/admin/engines`` (docs/operations.md
        "Following a request").
        """
        for engine in self.fleet.engines:
            metrics.ENGINE_STATE.labels(engine.name, engine.role).set(int(self.breakers.status(engine.name).state))

    def admitted(self, engine: Engine) -> bool:
        """Does the engine take requests now (a probe picks its partner by it)? False once it is forgotten."""
        if engine.name not in self.fleet.by_name:  # forgotten since (discovery)
            return False
        return self.breakers.admitted(engine.name, self._clock())

    def _placeable(self, engine: Engine) -> bool:
        """Admitted or quarantined (placement's fallback, docs/behaviour.md "Recovery"): whose load placement may
        weigh.
        """
        return self.breakers.status(engine.name).state in _LOAD_READ_STATES

    # -- reports ----------------------------------------------------------------------------------

    def drain(self) -> None:
        """The rings written since, their reports in completion order into the breakers (``supervisor.reports``)."""
        reports: list[Report] = []
        for slot in self._outcome_rings.written(self.shared.mm, self.shared.in_use()):
            reports.extend(self.shared.drain(slot))
        if reports:
            apply_reports(reports, self._by_slot, self.breakers, self._clock(), self._successes, self.reach)

    def drain_prefills(self) -> None:
        """The workers' completed prefills into the holdings (docs/behaviour.md "Placement"), then what changed
        published. Each prefill with reported cached tokens is judged once, in order of completion
        across workers: judged in ring order, a prefill that hit what another worker's finished a
        moment earlier would read as ``under`` and that one's as ``over``."""
        if self.holdings is None or self.model is None:
            return
        claimed = min(self.holdings.layout.slots, self.shared.in_use())  # slots ever claimed
        reports = [rep for slot in self._prefill_rings.written(self.holdings.mm, claimed)
                   for rep in self.holdings.drain(slot)]
        reports.sort(key=lambda rep: rep.at)
        apply = self.model.apply
        judged = [result for result in map(apply, reports) if result is not None]
        for result, counter in self._predictions.items():  # one inc per result a drain, not per prefill
            count = judged.count(result)
            if count:
                counter.inc(count)
        self.model.publish(self.holdings, self._clock())

    def sweep(self) -> None:
        """Give back the counts of workers that died without a word (kill -9, OOM)."""
        for slot in range(self.shared.in_use()):
            pid = self.shared.slot_pid(slot)
            if pid and not alive(pid):
                self.shared.drain(slot)
                # Under the claim lock, and only if the dead worker still holds it: a new worker
                # may have claimed the slot since (claim_slot reclaims dead owners' slots too).
                if self.shared.release(slot, pid):
                    log.warning("worker %d is gone: released its slot", pid)
                    if self.holdings is not None:
                        self.holdings.skip(slot)

    def export(self) -> None:
        """In-flight gauges every EXPORT_S: they move with every request; a scrape needs no fresher figure."""
        totals = self.shared.totals(self._span)
        for engine in self.fleet.engines:
            at = self._slot[engine.name]
            metrics.ENGINE_INFLIGHT.labels(engine.name, "prefill").set(totals[at * 2])
            metrics.ENGINE_INFLIGHT.labels(engine.name, "decode").set(totals[at * 2 + 1])
        # The workers already count their requests in shared memory (the retry budget reads
        # them): exported from here, the gauge costs the request path nothing.
        metrics.REQUESTS_INFLIGHT.set(self.shared.slot_field_total(L.SLOT_REQUESTS))

    # -- checks ---------------------------------------------------------------------------------

    def connected(self, engine: Engine, answered: bool, refused: bool) -> None:
        """A control read's word on reaching ``engine`` (:meth:`Checks.connected`)."""
        self.checks.connected(engine, answered, refused)

    def start(self, prober: Prober, loads: LoadReader) -> Loop:
        """Take over the last published state and publish it: what a (re)started loop begins with."""
        self.restore()
        if self.model is not None and self.holdings is not None:
            self.model.restore(self.holdings)
        self.publish()
        discovery = None
        if self.settings.discovery.enabled:  # imported only then: dnspython costs a static fleet's start nothing
            from narwhal.supervisor.discovery import Discovery

            discovery = Discovery(self, self.settings)
        next_health = self._clock() + self.settings.recovery.health_interval_s
        return Loop(prober, loads, discovery, os.getpid(), next_health)

    def step(self, loop: Loop) -> None:
        """One pass of the loop (the module's opening text): never awaits, so the beat goes on;
        what must wait (probes, health checks, load reads, discovery) is started, not awaited."""
        self.shared.beat(loop.pid)
        self.drain()
        self.drain_prefills()
        now = self._clock()
        self.breakers.tick(now)
        self.checks.start_probes(loop.prober, now)
        if now >= loop.next_health:
            health_every = self.settings.recovery.health_interval_s
            loop.next_health = now + health_every
            # A batch per pass of the loop (supervisor.rounds), not the whole fleet at once.
            self.rounds.spread(self.checks.health_round(loop.prober, now), min(health_every / 2, 1.0))
        load_every = self.settings.placement.load_interval_s
        if load_every > 0 and now >= loop.next_load:
            loop.next_load = now + load_every
            loop.loads.start_round((e for e in self.fleet.engines if self._placeable(e)), load_every / 2)
        self.rounds.run()
        if loop.discovery is not None:
            loop.discovery.tick(now)  # a read is started, never awaited here
        if now >= loop.next_sweep:
            loop.next_sweep = now + SWEEP_S
            self.sweep()
            if loop.discovery is not None:
                loop.discovery.sweep()
        if (self.breakers.version, self.reach.version) != self._published:
            self.publish()
        if loop.models is not None:  # after the publish: a readmission is read once it is published
            loop.models.tick(now)
        if now >= loop.next_export:
            loop.next_export = now + EXPORT_S
            self.export()

    async def run(self) -> None:
        """A pass (``step``) every LOOP_S until cancelled; reads and probes run in tasks, so no I/O delays the beat."""
        # engine.ca_file and the engine key come with the session (engines.control): health checks
        # and probes must reach engines as the request path does, or an https fleet is ejected.
        async with open_session(self.settings.engine) as session:
            load_every = self.settings.placement.load_interval_s
            # Each read bounded by the interval: a round never outlives the next one's start.
            loads = LoadReader(self.shared, PooledReader(self.settings.engine, load_every or 1.0),
                               on_reading=None if self.model is None else self.model.engine_read, rounds=self.rounds,
                               on_connect=self.connected)
            loop = self.start(Prober(self.settings, self.fleet, session, self.admitted), loads)
            loop.models = self.models = self.checks.models = ModelReader.over(self, session)
            await self._passes(loop)

    async def _passes(self, loop: Loop) -> None:
        """``step`` now and then LOOP_S after each pass ends, until cancelled or a pass raises.
        A timer callback of the event loop, not a task around ``asyncio.sleep``: a pass then costs
        no task step, coroutine resumption or future of its own (``perf.supervisor_pass``; figures in
        perf/RESULTS.md "Figures behind the code's choices")."""
        events = asyncio.get_running_loop()
        failed: asyncio.Future[None] = events.create_future()
        timer: asyncio.TimerHandle | None = None

        def one_pass() -> None:
            nonlocal timer
            try:
                self.step(loop)
            except Exception as exc:  # the run ends with it, as the awaited loop did
                if not failed.done():
                    failed.set_exception(exc)
                return
            timer = events.call_later(LOOP_S, one_pass)

        one_pass()
        try:
            await failed
        finally:
            if timer is not None:
                timer.cancel()
