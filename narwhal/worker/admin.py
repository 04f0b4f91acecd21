"""The admin API (docs/behaviour.md "The request path"): the fleet as the supervisor sees it, and operator actions.

Registered only when ``server.admin_token`` is set, so without one the routes answer 404
``not_found`` like any unknown route. Tokens are compared in constant time.

An action travels the worker's outcome ring to the supervisor (the only writer of breaker
state); the route waits, bounded, until the published record shows it, so the answer
already reflects the action on every worker that has a slot in shared memory. Every answer
says how many that is: ``"workers": {"reached": N, "running": M}``, the live workers with a
slot (those that read what the supervisor publishes) against the master's running workers.
A worker without a slot (``shm.local``) reaches only itself, and says so.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from narwhal import shm
from narwhal.engines.control import GENERATE_PATH, SCALE_OUT_REFUSAL
from narwhal.errors import RequestError
from narwhal.fleet import Engine
from narwhal.fleet.blame import State
from narwhal.reasons import Reason
from narwhal.request.admission import presented_token
from narwhal.request.router import Router
from narwhal.settings.effective import redacted
from narwhal.shm.local import LocalFleetState
from narwhal.shm.records import KIND_DRAIN, KIND_EJECT, KIND_READMIT, RECORD_KV_EVENTS, LoadRecord
from narwhal.shm.worker import WorkerFleetState
from narwhal.worker.guard import Handler

STATE_NAMES = tuple(state.name.lower() for state in State)  # index = the state's gauge value
# action -> (the command for the supervisor, the state that shows it took effect)
log = logging.getLogger("narwhal.worker.admin")

ACTIONS = {"eject": (KIND_EJECT, State.EJECTED), "readmit": (KIND_READMIT, State.ADMITTED),
           "drain": (KIND_DRAIN, State.DRAINING)}
_ACTION_WAIT_S = 2.0


def engine_view(router: Router, state: WorkerFleetState | LocalFleetState, engine: Engine) -> dict[str, Any]:
    """One engine as ``GET /admin/engines`` shows it: the published record, counts, load and holdings."""
    totals_p, totals_d = state.totals("prefill"), state.totals("decode")
    entry: dict[str, Any] = {
        "name": engine.name,
        "url": engine.url,
        "role": engine.role,
        "wave": engine.wave,
        "models": sorted(engine.models),
        # its /version as the supervisor read it (docs/decisions.md "vLLM releases"); null: not yet
        "version": engine.version,
        "transfer_mode": engine.transfer_mode,
        # docs/decisions.md "vLLM releases": an endpoint it answers 403 on, in the line preflight writes (vLLM without
        # --enable-scale-out)
        "refused_endpoints": {GENERATE_PATH: SCALE_OUT_REFUSAL} if engine.generate_refused else {},
        "state": "admitted",
        "failure_streak": 0,
        "ejections": 0,
        "quarantined_until": None,
        "unreachable": state.unreachable(engine),  # its last connection attempt failed (docs/behaviour.md "Recovery")
        "inflight": {"prefill": totals_p[engine.index], "decode": totals_d[engine.index]},
        "last_failure": None,
        "load": None,
        "holdings": router.placement.policy.describe(engine),  # what the placement policy knows of it
    }
    if isinstance(state, WorkerFleetState):
        entry["load"] = _load_view(state.load_readings()[engine.index])
        rec = state.records()[engine.index]
        if rec is None and not state.placeable(engine):
            entry["state"] = "probing"  # discovered, its first record not read yet (worker.roster_follow)
        if rec is not None:
            entry.update(
                state=STATE_NAMES[rec.state] if rec.state < len(STATE_NAMES) else "admitted",
                failure_streak=rec.failure_streak,
                ejections=rec.ejections,
                quarantined_until=rec.quarantined_until,
            )
            if rec.last_failure_reason is not None:
                entry["last_failure"] = {"reason": rec.last_failure_reason, "at": rec.last_failure_at}
            source = "events" if rec.flags & RECORD_KV_EVENTS else "learned"  # docs/behaviour.md "Placement"
            if isinstance(entry["holdings"], dict):
                entry["holdings"]["source"] = source
            elif source == "events":  # a consumer's (or a policy without holdings): where they would come from
                entry["holdings"] = {"source": source}
            if entry["state"] == "admitted" and not (engine.models_configured or engine.models_read):
                # Admitted, but this worker has not taken up its models yet, so
                # placement cannot use it: the answer says what placement does.
                entry["state"] = "probing"
    elif engine.index in state.out:
        entry["state"] = "ejected"
    return entry


def last_pair_gone(router: Router, engine: Engine) -> str | None:
    """What taking ``engine`` out left without service: the models it served that now have no
    pair in service and reachable (``/ready`` 503, requests 503 ``no_engine``), said in one line."""
    gone = [m for m in sorted(engine.models) if router.placement.unready(m) is not None]
    if not gone:
        return None
    return (f"engine {engine.name} was the last of its role in service for {', '.join(map(repr, gone))}: /ready "
            f"answers 503 and its requests 503 no_engine until an engine of its role is readmitted")


def workers_view(state: WorkerFleetState | LocalFleetState) -> dict[str, int]:
    """How many workers an action reaches, and how many run (an ``eject`` that answered
    "ejected" while workers beyond the layout's slots still used the engine)."""
    shared = shm.SHARED
    if shared is None:
        return {"reached": 1, "running": 1}  # no gunicorn: this process is the router
    running = [pid for pid in children_of(os.getppid()) if pid != shared.supervisor_pid]
    reached = shared.live_workers() if isinstance(state, WorkerFleetState) else 1
    return {"reached": reached, "running": max(len(running), reached)}


def children_of(pid: int) -> list[int]:
    """The children of ``pid`` (the gunicorn master): its workers and the supervisor."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _load_view(reading: LoadRecord | None) -> dict[str, Any] | None:
    """The engine's last ``/metrics`` reading (docs/behaviour.md "Placement"), however old: ``age_s`` says how old
    (placement ignores it past ``placement.load_stale_s``); null when there never was one."""
    if reading is None:
        return None
    return {
        "running": reading.running,
        "waiting": reading.waiting,
        "kv_usage": reading.kv_usage,
        "age_s": round(max(time.monotonic() - reading.read_at, 0.0), 3),
    }


def add_admin_routes(
    app: web.Application, token: str, router_key: Any, state_key: Any,
    wrap: Callable[[Handler], Handler],
) -> None:
    """``/admin/engines`` and its eject/readmit/drain actions, ``/admin/settings`` (the running
    settings, secrets redacted), every one behind the admin token;
    each handler registered through ``wrap`` (the app's error shaping, ``worker.guard``)."""
    expected = token.encode()

    def authorize(request: web.Request) -> None:
        if not hmac.compare_digest(presented_token(request), expected):
            raise RequestError("invalid or missing admin token", reason=Reason.UNAUTHORIZED)

    def json(data: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")

    async def list_engines(request: web.Request) -> web.Response:
        authorize(request)
        router: Router = request.app[router_key]
        state = request.app[state_key]
        return json({"engines": [engine_view(router, state, e) for e in router.fleet.engines],
                     "workers": workers_view(state)})

    async def act(request: web.Request) -> web.Response:
        authorize(request)
        router: Router = request.app[router_key]
        state = request.app[state_key]
        engine = router.fleet.by_name.get(request.match_info["name"])
        if engine is None:
            raise RequestError(f"no engine named {request.match_info['name']!r}", reason=Reason.NOT_FOUND)
        kind, target = ACTIONS[request.match_info["action"]]
        if isinstance(state, WorkerFleetState):
            state.command(kind, engine)
            end = time.monotonic() + _ACTION_WAIT_S
            while time.monotonic() < end:
                rec = state.records()[engine.index]
                if rec is not None and rec.state == target:
                    break
                await asyncio.sleep(0.005)
        elif kind == KIND_READMIT:
            state.out.discard(engine.index)
        else:
            state.out.add(engine.index)
        answer = {**engine_view(router, state, engine), "workers": workers_view(state)}
        if kind != KIND_READMIT:
            left = last_pair_gone(router, engine)
            if left:  # accepted, and said: the operator may not know it was the last one
                answer["warning"] = left
                log.warning("%s", left)
        return json(answer)

    async def effective_settings(request: web.Request) -> web.Response:
        authorize(request)
        return json(redacted(request.app[router_key].settings))

    app.router.add_get("/admin/engines", wrap(list_engines))
    app.router.add_get("/admin/settings", wrap(effective_settings))
    app.router.add_post(r"/admin/engines/{name}/{action:eject|readmit|drain}", wrap(act))
