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

import asyncio
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from narwhal.fake_engine import kv, passthrough
from narwhal.fake_engine.generate import handle_completion
from narwhal.fake_engine.state import EngineState

# Every route that generates, and the endpoint kind its frames and parsing follow.
GENERATING_ROUTES = {
    "/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages",
    "/v1/responses": "responses", "/inference/v1/generate": "generate",
}


def json_response(data: object, status: int = 200) -> web.Response:
    """A JSON body with ``status``."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def add_routes(app: web.Application, engine: EngineState) -> None:
    """Every route of one engine: the generating ones, vLLM's control routes and the fake's ``/fake/*``."""
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
        return await metrics_answer(engine)

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
    passthrough.add_routes(app, engine)  # /tokenize, /v1/embeddings, /score, /rerank ...


async def metrics_answer(engine: EngineState) -> web.Response:
    """``/metrics``, or its fault: ``hang`` answers only after the reader gave up (10 s: long
    for any load reader, short enough not to pile up handlers), ``garbage`` is not Prometheus."""
    engine.control_reads["metrics"] += 1
    fault = engine.faults.metrics
    if fault == "hang":
        await asyncio.sleep(10)
    if fault == "garbage":
        return web.Response(text="<html>502</html>\nvllm:num_requests_running{", content_type="text/html")
    return web.Response(text=render_metrics(engine), content_type="text/plain")


def render_metrics(engine: EngineState) -> str:
    """vLLM's scheduler and prefix-cache series (``vllm/v1/metrics/loggers.py``), true to the models.

    Same names, types and help texts as vLLM, labelled ``model_name`` and ``engine`` (the engine
    index, "0" for a single engine), labels and counters written as ``prometheus_client`` writes
    them (labels sorted; ``_total`` plus ``_created``). Running and waiting are the scheduler's
    (background load included); cache usage counts blocks in use, so cached blocks nobody uses
    are free, as in vLLM. The request phases' histograms (queue, prefill: ``fake_engine.histogram``)
    follow ``fake_engine.work``'s timestamps.
    """
    label = '{engine="0",model_name="' + engine.model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
    sched = engine.scheduler
    series = (
        ("num_requests_running", "gauge", "Number of requests in model execution batches.", sched.running),
        ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", sched.waiting),
        ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage()),
        (
            "prefix_cache_queries",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            engine.prefix_queries,
        ),
        ("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", engine.prefix_hits),
        ("request_success", "counter", "Count of successfully processed requests.", engine.completed_requests),
    )
    lines: list[str] = []
    for name, kind, help_text, value in series:
        if kind == "counter":
            # prometheus_client's text format: the family is ``…_total``, plus a ``…_created`` gauge.
            lines += [
                f"# HELP vllm:{name}_total {help_text}",
                f"# TYPE vllm:{name}_total counter",
                f"vllm:{name}_total{label} {float(value)}",
                f"# HELP vllm:{name}_created {help_text}",
                f"# TYPE vllm:{name}_created gauge",
                f"vllm:{name}_created{label} {float(engine.created)}",
            ]
        else:
            lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} gauge"]
            lines.append(f"vllm:{name}{label} {float(value)}")
    inner = label[1:-1]
    lines += engine.queue_time.lines("vllm:request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.", inner, engine.created)
    lines += engine.prefill_time.lines("vllm:request_prefill_time_seconds",
                                       "Histogram of time spent in PREFILL phase for request.", inner, engine.created)
    info = cache_config_info(engine) if engine.load_model.cache_config_info else ""
    return "\n".join(lines) + "\n" + info


def cache_config_info(engine: EngineState) -> str:
    """vLLM's ``vllm:cache_config_info``: an info gauge (1.0) labelled with its CacheConfig fields
    (``CacheConfig.metrics_info()``, every value as ``str()`` writes it) and the engine index.

    ``num_gpu_blocks`` is the fake's ``kv_blocks``, ``block_size`` its block size, and
    ``enable_prefix_caching`` its prefix cache; the rest are vLLM 0.11's defaults.
    """
    fields = {
        "block_size": str(engine.kv.block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": str(engine.load_model.prefix_cache),
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "kv_sharing_fast_prefill": "False",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(engine.load_model.kv_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "swap_space": "4",
        "swap_space_bytes": "4294967296",
    }
    labels = ",".join(f'{key}="{value}"' for key, value in fields.items())
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
    )
