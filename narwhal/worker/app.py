"""The aiohttp application and the factory gunicorn's aiohttp worker calls.

gunicorn loads ``narwhal.worker.app:create_app`` (no parentheses): an async zero-argument factory
returning a ``web.AppRunner``. That is the only way, under ``GunicornWebWorker``, to choose
``handler_cancellation`` — off by default in production yet forced on by aiohttp's test
server, so a router tested only there would leak upstream requests of departed clients in
production. Narwhal turns it on explicitly, everywhere.

Every POST route is one entry of ``narwhal.engines.endpoints``; its handler reads the worker's
router from a cell the startup hook fills and hands it the endpoint itself, and the error
shaping (``narwhal.worker.guard``: each route's own wrapper, not a middleware) has the header
limit bound when the app is built: no ``request.app[...]`` lookup (four calls each) on a request.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any

import orjson
from aiohttp import web

from narwhal import __version__, metrics
from narwhal.engines.endpoints import ENDPOINTS
from narwhal.fleet import Engine
from narwhal.request.admission import check_api_key
from narwhal.request.router import Router
from narwhal.settings import Settings, current_or_load
from narwhal.shm.worker import WorkerFleetState
from narwhal.worker import models_follow, roster_follow
from narwhal.worker.accept import BalancedSite, ConnectionShare, take_listeners
from narwhal.worker.admin import add_admin_routes
from narwhal.worker.compose import compose
from narwhal.worker.guard import Guard
from narwhal.worker.server import make_app_runner

log = logging.getLogger("narwhal.worker.app")

ROUTER = web.AppKey("router", Router)
SETTINGS = web.AppKey("settings", Settings)
_TASKS = web.AppKey("tasks", list)
STATE = web.AppKey("state", object)
_VERSION_BODY = web.AppKey("version_body", bytes)


_stop_requested_at: float | None = None
_runners: list[web.AppRunner] = []


def note_stop_requested(at: float) -> None:
    """SIGTERM reached this worker: stop accepting connections *now*.

    aiohttp's worker notices the signal up to a second later, then closes connections that
    have no request yet; a connection accepted in that second would be cut before its request
    is read (a reset at the client during a reload). Closing this worker's listener at once
    leaves new connections to the other (or the new) workers, and gives the ones already
    accepted that second to send their request.
    """
    global _stop_requested_at
    if _stop_requested_at is None:
        _stop_requested_at = at
    for runner in _runners:
        for site in runner.sites:
            if isinstance(site, BalancedSite):
                site.stop_accepting()
                continue
            server = getattr(site, "_server", None)
            if server is not None:
                server.close()


def _json(data: Any, status: int = 200, **headers: str) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


class _Served:
    """The worker's router, once ``_startup`` built it: the routes read it from here, one
    attribute, instead of ``request.app[ROUTER]`` (two calls) on every request."""

    __slots__ = ("router",)

    def __init__(self) -> None:
        self.router: Router | None = None


_SERVED = web.AppKey("served", _Served)


async def _models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    check_api_key(request, router.settings.server.api_keys)  # every /v1/* route needs the key
    created = int(time.time())
    engines = router.fleet.engines
    data = [model_card(m, engines, created) for m in sorted(router.fleet.served_models)]
    return _json({"object": "list", "data": data})


def model_card(model: str, engines: list[Engine], created: int) -> dict[str, object]:
    """``model`` as vLLM lists it: its ``root`` (its engines' own, else its name) and the
    smallest ``max_model_len`` of the engines serving it (a request that fits it fits any)."""
    serving = [e for e in engines if model in e.models]
    lengths = [e.max_model_len for e in serving if e.max_model_len]
    root = next((e.model_root[1] for e in serving if e.model_root and e.model_root[0] == model), model)
    card: dict[str, object] = {"id": model, "object": "model", "created": created, "owned_by": "narwhal",
                               "root": root, "parent": None}
    if lengths:
        card["max_model_len"] = min(lengths)
    return card


async def _health(request: web.Request) -> web.Response:
    # The worker's pid tells an operator (and the tests) which process answered.
    return _json({"status": "ok", "worker": os.getpid()})


def version_document(settings: Settings) -> dict[str, str | None]:
    """``GET /version``: this router's version and the engine version its contract pins."""
    pin = settings.engine_contract.engine_version if settings.engine_contract else ""
    return {"version": __version__, "engine_version": pin or None}


async def _version(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_VERSION_BODY], content_type="application/json")


async def _ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    models = router.fleet.served_models
    if not models:
        return _json({"ready": False, "reason": "no engine has reported a model yet"}, status=503)
    for model in sorted(models):  # docs/behaviour.md "Recovery": could a request succeed now?
        reason = router.placement.unready(model)
        if reason is not None:
            return _json({"ready": False, "reason": reason}, status=503)
    return _json({"ready": True})


async def _metrics(request: web.Request) -> web.Response:
    metrics.TALLY.flush()  # on the loop's thread: the tally is not shared with the executor
    engines = roster_follow.scraped(request.app[SETTINGS], request.app[ROUTER].fleet)  # forgotten ones left out
    body, content_type = await asyncio.get_running_loop().run_in_executor(None, metrics.render, engines)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _startup(app: web.Application) -> None:
    """Build what the worker serves with: its fleet state, placement, router; the engines' models
    as the supervisor read them (``worker.models_follow``: workers never read ``/v1/models``)."""
    settings = app[SETTINGS]
    pin = settings.engine_contract.engine_version if settings.engine_contract else ""
    metrics.publish_build_info(__version__, pin)
    fleet, state, follower, router = compose(settings)
    app[STATE] = state
    app[ROUTER] = router
    app[_SERVED].router = router
    models = models_follow.for_worker(fleet, by_slot=follower is not None)
    if models is not None:
        await models.first()  # the supervisor's first read of each engine, bounded
        app[_TASKS].append(asyncio.ensure_future(models.keep_following()))
    if follower is not None:  # engines that come and go (docs/behaviour.md "Engines that come and go")
        app[_TASKS].append(asyncio.ensure_future(follower.keep_following()))
    app[_TASKS].append(asyncio.ensure_future(metrics.TALLY.keep_flushing()))
    # Everything built so far lives as long as the worker: keep it out of the garbage
    # collector's scans, which otherwise walk it again on every full collection.
    gc.collect()
    gc.freeze()


async def _cleanup(app: web.Application) -> None:
    settings = app[SETTINGS]
    for task in app[_TASKS]:
        task.cancel()
    router = app[ROUTER]
    await router.drain_background(timeout=settings.engine.first_token_timeout_s)
    metrics.TALLY.flush()  # the last requests' counts, before the worker exits
    await router.client.close()
    router.access_log.close()
    if settings.tracing.enabled:
        from narwhal.request import tracing

        tracing.stop()  # the spans still in the batch go out before the worker exits


async def _shutdown(app: web.Application) -> None:
    settings = app[SETTINGS]
    # Runs when this worker stops, before aiohttp waits for the handlers: whatever is
    # still running at 85 % of the graceful timeout (counted from SIGTERM, after which
    # the master kills the worker) is ended with the terminal event.
    grace = settings.server.graceful_timeout_s * 0.85
    if _stop_requested_at is not None:
        grace -= asyncio.get_running_loop().time() - _stop_requested_at
    app[ROUTER].begin_drain(max(grace, 0.0))


def build_app(settings: Settings) -> web.Application:
    """The worker's aiohttp app: a route per ``ENDPOINTS`` entry, the control routes, the lifecycle."""
    served = _Served()
    guard = Guard(settings.server.max_header_bytes)  # every route's errors in shape (guard says why: no middleware)
    app = web.Application(client_max_size=settings.server.max_body_bytes)
    app[SETTINGS] = settings
    app[_TASKS] = []
    app[_VERSION_BODY] = orjson.dumps(version_document(settings))
    app[_SERVED] = served
    for endpoint in ENDPOINTS:  # every POST route, P/D and passthrough (docs/behaviour.md "The other P/D endpoints")
        app.router.add_post(endpoint.path, guard.route(endpoint, served))
    for path, handler in (("/v1/models", _models), ("/health", _health), ("/ready", _ready),
                          ("/version", _version), ("/metrics", _metrics)):
        app.router.add_get(path, guard.wrap(handler))
    if settings.server.admin_token:
        add_admin_routes(app, settings.server.admin_token, ROUTER, STATE, guard.wrap)
    guard.refuse_unrouted(app)  # last: it matches every path

    app.on_startup.append(_startup)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


# More header fields than this is refused (431) by the parser itself: no client needs them.
MAX_HEADER_FIELDS = 128


def make_runner(settings: Settings) -> web.AppRunner:
    """The app's runner with the settings' timeouts, on gunicorn's sockets when there are some."""
    # The parser's own limits sit above server.max_header_bytes so that the size check in
    # the route's guard (narwhal.worker.guard), which answers 431 in the OpenAI shape, is the one that decides.
    parser_limit = settings.server.max_header_bytes * 2
    app = build_app(settings)

    def share() -> ConnectionShare | None:
        state = app.get(STATE)
        return state if isinstance(state, WorkerFleetState) else None

    return make_app_runner(
        app,
        listeners=take_listeners(),
        share=share,
        handler_cancellation=True,
        keepalive_timeout=settings.server.keepalive_s,
        shutdown_timeout=settings.server.graceful_timeout_s * 0.95,
        access_log=None,
        max_field_size=parser_limit,
        max_line_size=parser_limit,
        max_headers=MAX_HEADER_FIELDS,
    )


async def create_app() -> web.AppRunner:
    """gunicorn's entry point: ``narwhal.worker.app:create_app``."""
    from narwhal.logs import configure_logging

    settings = current_or_load()
    configure_logging(settings.log)
    if settings.handoff.max_age_s <= settings.engine.prefill_timeout_s:
        log.warning(
            "handoff.max_age_s (%g) <= engine.prefill_timeout_s (%g): slow prefills will expire "
            "before their decode starts", settings.handoff.max_age_s, settings.engine.prefill_timeout_s,
        )
    runner = make_runner(settings)
    _runners.append(runner)
    return runner
