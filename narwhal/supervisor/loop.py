"""The supervisor's loop: a pass (:meth:`Loop.step`, which never awaits) every LOOP_S.

Time is the supervisor's injected clock, so a test drives the passes with a fake one
(tests/unit/supervisor/test_supervisor_loop.py). A pass:

1. beats (the master's keeper reads the heartbeat: a stale one means a wedged loop);
2. reads every worker's outcome ring, merges the reports in order of completion time and feeds
   them to the breakers (operator actions travel the same rings), and the prefills to the
   holdings;
3. lets time pass in the breakers (quarantine and wave-hold expiry), starts due probes;
4. starts what is due of the rounds of reads: health checks, load (``supervisor.load``, every
   ``placement.load_interval_s``), discovery's sources, the engines' models;
5. applies what the deciding parts returned (the load readings, discovery's joins and leavings,
   the models read), and publishes once any status changed (``supervisor.edge``: the one writer).

Less often: sweeping slots of dead workers, forgetting drained engines, following the engines'
KV-cache events (``supervisor.kv_events``: a subscription per engine), exporting the in-flight
gauges. Whatever must wait (probes, health checks, reads) is started, never awaited, so the
beat goes on.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from narwhal.engines.control import PooledReader, open_session
from narwhal.supervisor.edge import LOOP_S, Supervisor
from narwhal.supervisor.kv_events.hub import KvEventsHub
from narwhal.supervisor.load import LoadReader
from narwhal.supervisor.models import ModelReader
from narwhal.supervisor.probes import Prober

if TYPE_CHECKING:  # discovery is imported only when enabled (dnspython)
    from narwhal.supervisor.discovery import Discovery

SWEEP_S = 0.25
EXPORT_S = 1.0


@dataclass
class Loop:
    """What the loop's passes carry from one to the next: the checkers and when each is next due."""

    sup: Supervisor
    prober: Prober
    loads: LoadReader
    discovery: Discovery | None
    pid: int
    next_health: float
    next_load: float = 0.0
    next_sweep: float = 0.0
    next_export: float = 0.0

    @classmethod
    def start(cls, sup: Supervisor, prober: Prober, loads: LoadReader) -> Loop:
        """Take over the last published state and publish it: what a (re)started loop begins with."""
        sup.restore()
        if sup.part is not None:
            sup.part.restore()
        sup.publish()
        discovery = None
        if sup.settings.discovery.enabled:  # imported only then: dnspython costs a static fleet's start nothing
            from narwhal.supervisor.discovery import Discovery

            discovery = Discovery(sup, sup.settings)
        next_health = sup.now() + sup.settings.recovery.health_interval_s
        return cls(sup, prober, loads, discovery, os.getpid(), next_health)

    def step(self) -> None:
        """One pass of the loop (the module's opening text)."""
        sup = self.sup
        sup.shared.beat(self.pid)
        sup.drain()
        sup.drain_policy()
        now = sup.now()
        sup.breakers.tick(now)
        sup.checks.start_probes(self.prober, now)
        if now >= self.next_health:
            health_every = sup.settings.recovery.health_interval_s
            self.next_health = now + health_every
            # A batch per pass of the loop (supervisor.rounds), not the whole fleet at once.
            sup.rounds.spread(sup.checks.health_round(self.prober, now), min(health_every / 2, 1.0))
        load_every = sup.settings.placement.load_interval_s
        if load_every > 0 and now >= self.next_load:
            self.next_load = now + load_every
            self.loads.start_round((e for e in sup.fleet.engines if sup.placeable(e)), load_every / 2)
        sup.rounds.run()
        sup.shared.publish_loads(self.loads.take())  # the readings that came since the last pass
        if self.discovery is not None:  # a read is started, never awaited here
            decided = self.discovery.tick(now, sup)
            if decided:
                sup.apply_membership(decided, self.discovery.refused)
                self.discovery.export(sup)
        if now >= self.next_sweep:
            self.next_sweep = now + SWEEP_S
            sup.sweep()
            if sup.kv_events is not None:  # engines that joined subscribe, those that left end theirs
                sup.kv_events.follow((e.name, e.url) for e in sup.fleet.engines)
            if self.discovery is not None:  # and the gauge follows the engines' states
                sup.apply_membership(self.discovery.sweep(sup, sup.shared.totals(sup.slots)), self.discovery.refused)
                self.discovery.export(sup)
        sup.publish_if_moved()
        sup.tick_models(now)  # after the publish: a readmission is read once it is published
        if now >= self.next_export:
            self.next_export = now + EXPORT_S
            sup.export()

    async def passes(self) -> None:
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
                self.step()
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


async def run(sup: Supervisor) -> None:
    """A pass every LOOP_S until cancelled; reads and probes run in tasks, so no I/O delays the beat."""
    # engine.ca_file and the engine key come with the session (engines.control): health checks
    # and probes must reach engines as the request path does, or an https fleet is ejected.
    settings = sup.settings
    async with open_session(settings.engine) as session:
        load_every = settings.placement.load_interval_s
        # Each read bounded by the interval: a round never outlives the next one's start.
        loads = LoadReader(sup.shared, PooledReader(settings.engine, load_every or 1.0),
                           on_reading=None if sup.part is None else sup.part.on_reading, rounds=sup.rounds,
                           on_connect=sup.connected)
        loop = Loop.start(sup, Prober(settings, sup.fleet, session, sup.admitted), loads)
        sup.read_models(ModelReader.over(session, settings.engine, sup.rounds, settings.recovery.health_interval_s))
        if settings.placement.kv_events:  # one subscription per engine per host (supervisor.kv_events)
            sup.kv_events = KvEventsHub(session, sup.kv_events_reset)
        try:
            await loop.passes()
        finally:
            if sup.kv_events is not None:
                sup.kv_events.close()
            if loop.discovery is not None:
                loop.discovery.close()
