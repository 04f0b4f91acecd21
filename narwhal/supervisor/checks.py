"""The supervisor's checks of engines: readmission probes and health checks, and what a control
read says of reaching an engine (docs/behaviour.md "Recovery").

Invariant: the loop's pass (``supervisor.loop``) only *starts* a check; each runs in a task of
its own and reports to the breakers when it ends, so no engine, however slow, delays the
heartbeat. A probe runs at most once at a time per engine; a check of an engine forgotten
meanwhile (discovery) changes nothing. A crashing probe is an inconclusive one, never the end
of the supervisor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from narwhal import metrics
from narwhal.engines.control import UNREACHABLE
from narwhal.fleet import Engine, Fleet
from narwhal.supervisor.membership import ChangingBreakers
from narwhal.supervisor.probes import Prober
from narwhal.supervisor.reachability import Reachability

if TYPE_CHECKING:
    from narwhal.supervisor.models import ModelReader

log = logging.getLogger("narwhal.supervisor")


class Checks:
    """Starts probes and health checks from the loop's passes and feeds their results to the
    breakers; keeps whose last connection attempt failed (``supervisor.reachability``)."""

    def __init__(
        self, fleet: Fleet, breakers: ChangingBreakers, reach: Reachability, clock: Callable[[], float]
    ) -> None:
        self.fleet = fleet  # the supervisor's: discovery changes it in place
        self.breakers = breakers
        self.reach = reach
        self._clock = clock
        self.models: ModelReader | None = None  # set once the supervisor runs: /version is read again through it
        # Told of an engine that answers again after refusing connections (maybe a new process,
        # whose cache is empty): the placement policy's part forgets what it learned of it.
        self.came_back: Callable[[Engine], None] | None = None
        self._probing: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    def connected(self, engine: Engine, answered: bool, refused: bool) -> None:
        """A control read's word on reaching ``engine`` (``supervisor.reachability``): no connection says
        unreachable, any HTTP answer reachable (whatever its status), a timeout nothing. An engine
        that answers again after refusing connections may be a new process — a rolling upgrade's
        next release — so its ``/version`` and models are read again (``supervisor.models``,
        paced: at most a round per engine per ``health_interval_s``); a ``/version`` it cannot
        give leaves its version unknown, never the engine unreachable (docs/behaviour.md); what
        placement learned it holds is forgotten (``came_back``): a restarted consumer tells no
        other way that its cache is empty."""
        if refused:
            self.reach.saw(engine.name, False)
        elif answered:
            came_back = self.reach.unreachable(engine.name)
            self.reach.saw(engine.name, True)
            if came_back and self.models is not None:
                self.models.reread(engine)
            if came_back and self.came_back is not None:
                self.came_back(engine)

    def start_probes(self, prober: Prober, now: float) -> None:
        """Start every probe the breakers say is due, unless that engine's last one still runs."""
        for plan in self.breakers.due_probes(now):
            if plan.engine not in self._probing:
                self._probing.add(plan.engine)
                self._spawn(self._probe(prober, self.fleet.by_name[plan.engine], plan))

    def health_round(self, prober: Prober, now: float) -> list[Callable[[], None]]:
        """One start per admitted engine's health check, for the loop to spread over its passes."""
        checked = [e for e in self.fleet.engines if self.breakers.admitted(e.name, now)]
        return [functools.partial(self._spawn_health, prober, e) for e in checked]

    @property
    def under_way(self) -> list[asyncio.Task[Any]]:
        """The probes and health checks still running (a test lets them end)."""
        return [task for task in self._tasks if not task.done()]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, prober: Prober, engine: Engine, plan: Any) -> None:
        try:
            result, why = await prober.probe(engine, plan.kind, plan.as_producer, plan.as_consumer, plan.producer)
        except Exception:  # a probe must never take the supervisor down
            log.exception("probe of %s crashed", engine.name)
            result, why = "inconclusive", "the probe crashed"
        finally:
            self._probing.discard(engine.name)
        if why:  # every probe that did not pass says why, at warning when it failed
            log.log(logging.WARNING if result == "fail" else logging.INFO,
                    "probe of %s (%s): %s: %s", engine.name, plan.kind, result, why)
        else:
            log.info("probe of %s (%s): %s", engine.name, plan.kind, result)
        metrics.PROBES.labels(engine.name, result).inc()
        self.breakers.probe_result(engine.name, result, self._clock())
        if result == "pass":  # it answered every leg of the probe: a readmission says reachable
            self.reach.saw(engine.name, True)

    def _spawn_health(self, prober: Prober, engine: Engine) -> None:
        self._spawn(self._health(prober, engine))

    async def _health(self, prober: Prober, engine: Engine) -> None:
        sent_at = self._clock()
        failure = await prober.health_failure(engine)
        if engine.name not in self.fleet.by_name:  # forgotten meanwhile (discovery)
            return
        self.connected(engine, failure is None or failure.startswith("HTTP "), failure == UNREACHABLE)
        if failure is None and engine.name not in self._probing:  # a DEGRADED one: the probe an ejected one gets
            plan = self.breakers.degraded_probe(engine.name, self._clock())
            if plan is not None:
                self._probing.add(engine.name)
                self._spawn(self._probe(prober, engine, plan))
        if failure is not None:
            log.warning("health check of %s: fail: %s", engine.name, failure)
            now = self._clock()
            if self.breakers.admitted(engine.name, now):
                self.breakers.health_failed(engine.name, now, "health_check", sent_at=sent_at)
