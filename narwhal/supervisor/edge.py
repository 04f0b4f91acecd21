"""The supervisor's state, and the edge where its decisions take effect: the one writer of breaker state.

It holds the fleet as the supervisor knows it (each engine at its slot in the shared table), the
breakers, the reachability and the placement policy's part (``supervisor.policy_part``); its
loop (``supervisor.loop``) calls it a pass at a time. Invariants, and why:

* **Decisions in, effects at the edge.** Discovery and the model reader decide from what they
  read and return decisions (``supervisor.membership``'s ``Join``/``Drain``/``Readmit``/``Forget``,
  ``supervisor.models``'s ``ModelsRead``/``ModelsPublished``); the breakers decide from the
  reports. Only the methods here write shared memory (:meth:`Supervisor.publish`,
  :meth:`Supervisor.apply_membership`, :meth:`Supervisor.apply_models`), so who wrote a record is
  never in doubt and the deciding parts are tested with no region at all.
* **Publish once per change**: once any status changed, every engine record is written under the
  next generation, then the generation is bumped, so workers re-read the records on their next
  request: an ejection is visible fleet-wide within one loop period (~20 ms) of the report that
  caused it; the state gauges follow at once.
* **A restart loses nothing**: a (re)started supervisor takes the last published records as its
  starting state (``supervisor.engine_records``), so a restart loses no ejection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from narwhal import metrics
from narwhal.fleet import Engine, Fleet, compat
from narwhal.settings import Settings
from narwhal.settings.engines import EngineSpec
from narwhal.shm import descriptors
from narwhal.shm import layout as L
from narwhal.shm import models as M
from narwhal.shm.layout import TABLE_LOCK
from narwhal.shm.records import RecordBusy, Report, read_record, write_record
from narwhal.shm.shared import SharedFleet, alive
from narwhal.shm.table import TableFull, identity, record_hash
from narwhal.supervisor import engine_records
from narwhal.supervisor.breaker import EngineInfo, State
from narwhal.supervisor.checks import Checks
from narwhal.supervisor.kv_events.hub import KvEventsHub
from narwhal.supervisor.kv_events.stream import Stream
from narwhal.supervisor.membership import ChangingBreakers, Decision, Drain, Forget, Join, Readmit
from narwhal.supervisor.models import ModelReader, ModelsPublished, ModelsRead
from narwhal.supervisor.policy_part import PolicyPart, policy_part
from narwhal.supervisor.reachability import Reachability
from narwhal.supervisor.reports import RingIndexes, Successes, apply_reports
from narwhal.supervisor.rounds import Rounds
from narwhal.supervisor.transitions import log_charges, log_transitions

log = logging.getLogger("narwhal.supervisor")

# Draining engines too: their load shows, and a drained engine restarted for an upgrade is seen
# refusing and answering again, so its new version is read before an operator readmits it.
_LOAD_READ_STATES = frozenset({State.ADMITTED, State.DEGRADED, State.QUARANTINED, State.DRAINING})
LOOP_S = 0.02  # ejections reach every worker within one loop: ~20 ms, well under docs/behaviour.md "Processes"'s 100 ms


class Supervisor:
    """The supervisor's state and its edge: the one writer of breaker, load and model records."""

    def __init__(self, shared: SharedFleet, settings: Settings, policy_region: Any = None,
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
        self.models: ModelReader | None = None  # set by read_models: the engines' /version and /v1/models
        self._map_slots()
        self._outcome_rings = RingIndexes(shared.layout.slot_offset(0) + L.SLOT_RING_WRITE, shared.layout.slot_size)
        self._successes = Successes()
        self._published = (-1, -1, -1)  # the (breakers, reachability, KV events) versions last published
        self.kv_events: KvEventsHub | None = None  # the engines' KV-event subscriptions (supervisor.loop starts it)
        self._states: dict[str, State] = {}  # each engine's state as last published, for the transition lines
        self.checks = Checks(self.fleet, self.breakers, self.reach, clock)  # probes and health checks
        self.rounds = Rounds(LOOP_S)  # health checks, load and model reads: a batch per pass (supervisor.rounds)
        self._wall = time.time() - clock()
        # The placement policy's supervisor part, over its shared memory (None: it keeps none).
        self.part: PolicyPart | None = policy_part(settings, policy_region, self.fleet.engines, self._followed)
        if self.part is not None:
            self.checks.came_back = self.part.forget

    def _infos(self) -> list[EngineInfo]:
        """Blame's view of each engine: its partners are the *compatible* permitted ones (versions,
        transfer modes: docs/decisions.md "vLLM releases"), so during a mixed-version window a
        consumer with one compatible producer is judged as having one (``fleet.blame``)."""
        return [EngineInfo(name=e.name, role=e.role, wave=e.wave,
                           permitted_consumers=frozenset(d.name for d in e.permitted_consumers
                                                         if compat.compatible(e, d)),
                           permitted_producers=frozenset(p.name for p in e.permitted_producers
                                                         if compat.compatible(p, e)))
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

    def now(self) -> float:
        """The supervisor's clock: every decision's time (a fake one in the loop's tests)."""
        return self._clock()

    def slot_of(self, engine: Engine) -> int:
        """The engine's slot in the shared table: where its records sit (``shm.table``)."""
        return self._slot[engine.name]

    def set_engines(self, members: list[tuple[int, EngineSpec]], joining: set[str]) -> None:
        """Discovery: the engines become ``members`` (engine slot, entry); those named in
        ``joining`` start PROBING (``supervisor.membership``)."""
        self.fleet.replace(members)
        self.specs = {spec.name: spec for _, spec in members}
        self.breakers.reshape(self._infos(), joining, self._clock())
        if self.part is not None:  # a discovered producer gets its section
            self.part.reshape(self.fleet.engines)
        for name in self.reach.names():
            if name not in self.fleet.by_name:  # gone from the fleet: nothing is remembered of it
                self.reach.forget(name)
        self._map_slots()

    # -- state ------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Start from the records a previous supervisor published (none at first start)."""
        metrics.fleet_series()  # zero from the first scrape (metrics.engine_series: per engine, at publish)
        now = self._clock()
        for engine in self.fleet.engines:
            try:  # no supervisor is writing now: a record its predecessor left mid-write counts if whole
                rec = read_record(self.shared.region, self.slot_of(engine), writer_gone=True)
            except RecordBusy:
                continue
            was = engine_records.restored(engine, rec, self._wall)
            if was is None:
                continue
            self.breakers.restore(was.status, now, by_operator=was.by_operator, waiting=was.waiting)
            self._states[engine.name] = was.status.state
            if was.unreachable:
                self.reach.saw(engine.name, False)
        self.reach.take_changes()  # taken over, not news

    def publish(self) -> None:
        """Every engine's record under the next generation, then the bump: workers re-read once they see it."""
        version = self.shared.generation + 1  # each record carries it: shm.worker waits for it
        events = self.kv_events
        for engine in self.fleet.engines:
            follows = events is not None and events.source(engine.name) == "events"
            write_record(self.shared.region, self.slot_of(engine),
                         engine_records.record(engine, self.breakers, self.reach, version, self._wall, follows))
        self.shared.bump_generation()
        self._published = (self.breakers.version, self.reach.version, self._events_version())
        log_charges(self.fleet.engines, self.breakers.take_charged())
        log_transitions(self.fleet.engines, self.breakers, self.reach, self._states, self.settings.recovery)
        if self.part is not None:
            self.part.states(self.fleet.engines, lambda engine: self.breakers.status(engine.name).state)
        self.export_states()

    def publish_if_moved(self) -> None:
        """Publish once any breaker or reachability moved since the last publish."""
        if (self.breakers.version, self.reach.version, self._events_version()) != self._published:
            self.publish()

    def _events_version(self) -> int:
        return -1 if self.kv_events is None else self.kv_events.version

    def _followed(self) -> dict[int, Stream]:
        """Per engine index, its KV-event subscription (what the policy's part reads of its blocks)."""
        events = self.kv_events
        if events is None or not events.streams:
            return {}
        streams = events.streams
        return {e.index: stream for e in self.fleet.engines if (stream := streams.get(e.name)) is not None}

    def kv_events_reset(self, name: str, why: str) -> None:
        """An engine's KV events say its cache is not what was known (a restart, a cleared cache,
        a gap its replay could not fill): the policy's part forgets what it learned of it at once."""
        engine = self.fleet.by_name.get(name)
        if engine is not None and self.part is not None:
            self.part.forget(engine)

    def export_states(self) -> None:
        """Engine states as gauges at every publish: within one loop of ``/admin/engines``
        (docs/operations.md "Following a request").
        """
        for engine in self.fleet.engines:
            metrics.ENGINE_STATE.labels(engine.name, engine.role).set(int(self.breakers.status(engine.name).state))
            metrics.engine_series(engine.name, engine.role)  # once per engine (cached): zero from the first scrape

    def admitted(self, engine: Engine) -> bool:
        """Does the engine take requests now (a probe picks its partner by it)? False once it is forgotten."""
        if engine.name not in self.fleet.by_name:  # forgotten since (discovery)
            return False
        return self.breakers.admitted(engine.name, self._clock())

    def placeable(self, engine: Engine) -> bool:
        """Admitted or quarantined (placement's fallback, docs/behaviour.md "Recovery"): whose load
        placement may weigh.
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

    def drain_policy(self) -> None:
        """The placement policy's part takes what the workers reported since the last pass
        (``supervisor.policy_part``)."""
        if self.part is not None:
            self.part.drain(self.shared.in_use(), self._clock())

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
                    if self.part is not None:
                        self.part.worker_gone(slot)

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

    # -- what discovery reads of the running fleet (supervisor.discovery.decisions.Running) -----------------

    @property
    def slots(self) -> int:
        """How many engines the shared table holds at most."""
        return self.shared.layout.engines

    def state(self, name: str) -> State:
        """``name``'s breaker state now."""
        return self.breakers.status(name).state

    def joining(self, name: str) -> bool:
        """Is ``name`` still in its first checks (PROBING since it joined)?"""
        return self.breakers.joining(name)

    # -- the edge: decisions applied ------------------------------------------------------------

    def apply_membership(self, decisions: Iterable[Decision], refused: Callable[[Join, str, bool], None]) -> None:
        """Discovery's decisions taken up (``supervisor.discovery``); a join the table cannot take
        told back through ``refused(join, why, passing)``."""
        for decision in decisions:
            if isinstance(decision, Drain):
                self.breakers.drain(decision.name, self._clock(), by="discovery")
            elif isinstance(decision, Readmit):
                self.breakers.readmit(decision.name, self._clock(), by="discovery")
            elif isinstance(decision, Join):
                self._join(decision, refused)
            else:
                self._forget(decision)

    def _join(self, join: Join, refused: Callable[[Join, str, bool], None]) -> None:
        """Under the table lock: a spare slot, the descriptor there, the engine PROBING and its record
        published, and only then the entry LIVE (a worker taking it up finds both)."""
        spec, source = join.spec, join.source
        ident = identity(spec.name, spec.url)
        with self.shared.locked(TABLE_LOCK):  # one table writer at a time (shm.table)
            try:
                blob = descriptors.encode(spec.model_dump(), source)
                slot = self.shared.table.spare_slot(ident, self.shared.oldest_worker_epoch())
            except (TableFull, descriptors.DescriptorTooLong, TypeError, ValueError) as exc:
                refused(join, str(exc), isinstance(exc, TableFull))
                return
            descriptors.write(self.shared.region, slot, blob)
            members_now = [(e.index, self.specs[e.name]) for e in self.fleet.engines] + [(slot, spec)]
            self.sources[spec.name] = source
            self.set_engines(members_now, {spec.name})
            self.publish()  # its PROBING record before the entry turns LIVE
            self.shared.table.make_live(slot, ident)
        log.info("discovery: %s: engine %s at %s joins (slot %d), probing", source, spec.name, spec.url, slot)

    def _forget(self, forget: Forget) -> None:
        engine = self.fleet.by_name[forget.name]
        with self.shared.locked(TABLE_LOCK):
            members = [(e.index, self.specs[e.name]) for e in self.fleet.engines if e.name != engine.name]
            self.set_engines(members, set())
            self.shared.table.retire(engine.index)
        self.shared.forget_slots()  # its slot may go to another engine: no look-up may keep it
        self.sources.pop(engine.name, None)
        metrics.forget_engine(engine.name, engine.role)
        log.info("discovery: engine %s at %s drained and forgotten (slot %d retired)",
                 engine.name, engine.url, engine.index)

    def read_models(self, reader: ModelReader) -> ModelReader:
        """Take ``reader`` up as the engines' model reader, from what a predecessor published."""
        published = []
        for engine in self.fleet.engines:
            try:  # no supervisor is writing now: a record left mid-write counts if whole
                rec = M.read_models(self.shared.region, self.slot_of(engine), writer_gone=True)
            except RecordBusy:
                continue
            if rec is not None and rec.name_hash == record_hash(engine.name, engine.url):
                published.append((engine, rec))
        self.apply_models(reader.restore(published))
        self.models = self.checks.models = reader
        return reader

    def tick_models(self, now: float) -> None:
        """The model reader's pass: what it decided, applied."""
        if self.models is not None:
            self.apply_models(self.models.tick(now, self.fleet, self.breakers))

    def apply_models(self, decisions: Iterable[ModelsRead | ModelsPublished]) -> None:
        """The model reader's decisions taken up: the fleet's models and versions (what probes and
        pairing read here), and the records published under the next models generation."""
        for decision in decisions:
            if isinstance(decision, ModelsRead):
                engine = decision.engine
                if decision.models is not None:
                    self.fleet.set_models(engine, decision.models)  # logs the change; probes' fallback model
                if decision.version_moved:
                    self._set_version(engine, decision.version)
                continue
            version = M.generation(self.shared.region) + 1
            for engine, rec in decision.records:
                M.write_models(self.shared.region, self.slot_of(engine), replace(rec, version=version))
            M.bump_generation(self.shared.region)

    def _set_version(self, engine: Engine, version: str | None) -> None:
        old = engine.version
        self.fleet.set_version(engine, version)
        if old != version:  # which pairs are compatible moved: blame judges by those
            self.breakers.reshape(self._infos(), set(), self._clock())
        if version is None:
            return
        if old is not None and old != version:
            # A multiprocess series cannot be removed (its file keeps it): the old version reads 0.
            metrics.ENGINE_INFO.labels(engine.name, engine.role, old).set(0)
        metrics.ENGINE_INFO.labels(engine.name, engine.role, version).set(1)
