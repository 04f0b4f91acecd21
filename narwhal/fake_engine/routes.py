"""The fake engine's small routes: vLLM's operational endpoints and the fake's own ``/fake/*``.

These mirror what a router's probes and preflight touch on a real vLLM server
(VLLM-PROTOCOL.md A.4): ``/health`` with an empty body (503 when the engine is dead),
``/version``, ``/v1/models``, ``/load`` and a Prometheus ``/metrics`` in vLLM's naming. The heavy
route, completions, lives in ``generate.py``.

Invariant: handlers are typed against ``state.EngineState`` and this module never imports
``engine``: ``engine.build_engine_app`` calls ``add_routes``, so the app is assembled at the top of
the package and the request path below it has no import cycle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from narwhal.fake_engine import kv
from narwhal.fake_engine.generate import handle_completion
from narwhal.fake_engine.state import EngineState

# Every route that generates, and the endpoint kind its frames and parsing follow.
GENERATING_ROUTES = {
    "/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages",
    "/v1/responses": "responses", "/inference/v1/generate": "generate",
}


def json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def add_routes(app: web.Application, engine: EngineState) -> None:
    def generating(kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def route(request: web.Request) -> web.StreamResponse:
            return await handle_completion(engine, request, kind)

        return route

    async def health(request: web.Request) -> web.Response:
        engine.control_reads["health"] += 1
        return web.Response(status=engine.faults.health_status or 200)

    async def version(request: web.Request) -> web.Response:
        engine.control_reads["version"] += 1
        return json_response({"version": engine.version})

    async def models(request: web.Request) -> web.Response:
        engine.control_reads["models"] += 1
        data: list[dict[str, object]] = [
            {
                "id": name,
                "object": "model",
                "created": engine.created,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": engine.max_model_len,
                "permission": [],
            }
            for name in engine.models
        ]
        return json_response({"object": "list", "data": data})

    async def load(request: web.Request) -> web.Response:
        return json_response({"server_load": engine.active_requests})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=render_metrics(engine), content_type="text/plain")

    async def stats(request: web.Request) -> web.Response:
        return json_response(engine.stats())

    async def kv_read(request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return json_response({"ok": False, "reason": "invalid JSON"}, status=400)
        status, data = kv.serve_read(engine, body)
        return json_response(data, status=status)

    for path, kind in GENERATING_ROUTES.items():
        app.router.add_post(path, generating(kind))
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/fake/stats", stats)
    app.router.add_post("/fake/kv/read", kv_read)


def render_metrics(engine: EngineState) -> str:
    """A few gauges and counters named like vLLM's, enough for a scraper or a load-aware policy."""
    label = '{engine="0",model_name="' + engine.model.replace('"', '\\"') + '"}'
    store = engine.kv
    usage = min(1.0, store.held_blocks / 10000.0)
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{label} {float(engine.active_requests)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{label} 0.0",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{label} {usage}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        f"vllm:request_success_total{label} {float(engine.completed_requests)}",
    ]
    return "\n".join(lines) + "\n"
