"""The worker's composition root: its fleet and fleet state, placement, outcomes and router,
built from the settings in one place and handed to the router by name (``RouterParts``).

Why one place: which state a worker gets (its shared-memory slot, or process-local without one),
whether it follows the engine table, sees its placement policy's shared memory, or traces, is decided here once at start
and never again per request; the app (``worker.app``) only serves what this built.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from narwhal import shm
from narwhal.engines.client import EngineClient
from narwhal.fleet import Fleet
from narwhal.fleet.placement.policy import part
from narwhal.fleet.placement.registry import build, region
from narwhal.request.accesslog import AccessLog
from narwhal.request.outcomes import Outcomes
from narwhal.request.router import Router, RouterParts
from narwhal.request.slot_wait import WaitingPlacement
from narwhal.settings import Settings
from narwhal.shm.local import LocalFleetState
from narwhal.shm.worker import UnmappedEngine, WorkerFleetState
from narwhal.worker import roster_follow

log = logging.getLogger("narwhal.worker")


def compose(settings: Settings) -> tuple[Fleet, WorkerFleetState | LocalFleetState, roster_follow.RosterFollower | None,
                                         Router]:
    """The worker's fleet, its fleet state, the table follower (with ``[discovery]``) and its router."""
    fleet, state, follower = roster_follow.fleet_and_state(settings, worker_state)  # with [discovery]: the table's
    loads = state if isinstance(state, WorkerFleetState) else None  # engine reports come from the supervisor
    view = policy_view(settings, fleet, state)
    if follower is not None:
        follower.policy_view = view  # it follows the engine table too
    parts = RouterParts(
        settings=settings,
        fleet=fleet,
        placement=WaitingPlacement(fleet, state, state, settings.placement, loads=loads,
                                   policy=build(settings.placement, view)),
        client=EngineClient.for_settings(settings.engine),
        outcomes=Outcomes(fleet, state, settings.recovery.failure_quarantine_s),
        state=state,
        access_log=AccessLog(settings.log.access_log),
    )
    if settings.tracing.enabled:  # imported only then: with tracing off, OpenTelemetry is never loaded
        from narwhal.request import tracing

        return fleet, state, follower, tracing.TracedRouter(parts, tracer=tracing.start(settings.tracing))
    return fleet, state, follower, Router(parts)


def worker_state(fleet: Fleet, by_slot: bool = False) -> WorkerFleetState | LocalFleetState:
    """This worker's slot in the shared fleet state, or process-local state without one
    (``by_slot``: a fleet that follows the engine table, ``worker.roster_follow``)."""
    shared = shm.SHARED
    if shared is not None:
        if len(fleet.engines) > shared.layout.engines:
            log.error("%d engines exceed the shared layout (%d): fleet state is per worker",
                      len(fleet.engines), shared.layout.engines)
        else:
            slot = shared.claim_slot(os.getpid())
            if slot is not None:
                try:
                    return WorkerFleetState(shared, slot, fleet, by_slot=by_slot)
                except UnmappedEngine as exc:
                    shared.release(slot, os.getpid())
                    log.error("engines without a slot in the shared table (%s): fleet state is per worker", exc)
            else:
                log.error("no free worker slot in the shared layout: fleet state is per worker")
    return LocalFleetState(fleet)


def policy_view(settings: Settings, fleet: Fleet, state: WorkerFleetState | LocalFleetState) -> Any:
    """This worker's view of its placement policy's shared memory (``PolicyRegion.worker``: the
    policy names it), which the policy is built with; None without the region (outside gunicorn,
    or a policy that asks for none)."""
    need = region(settings.placement)
    if need is None or shm.POLICY_REGION is None or not isinstance(state, WorkerFleetState):
        return None
    return part(need.worker)(shm.POLICY_REGION, fleet.engines, state.slot)
