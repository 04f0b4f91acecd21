"""The fake engine's small routes: vLLM's operational endpoints and the fake's own ``/fake/*``.

These mirror what a router's probes and preflight touch on a real vLLM server
(vLLM's OpenAI server, `vllm/entrypoints/openai/`): ``/health`` with an empty body (503 when the engine is dead),
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


# vLLM 0.33's answer on /inference/v1/generate without --enable-scale-out (create_error_response).
SCALE_OUT_DISABLED = {"error": {
    "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
    "type": "PermissionDeniedError", "param": None, "code": 403}}


def _permission(created: int) -> dict[str, object]:
    """vLLM's ``ModelPermission`` (``openai/models/protocol.py``), as a real engine lists it."""
    return {
        "id": f"modelperm-{created:016x}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False,
    }


def json_response(data: object, status: int = 200) -> web.Response:
    """A JSON body with ``status``."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _generating(engine: EngineState, kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of one generating route, as the engine's release serves it (or does not)."""
    async def route(request: web.Request) -> web.StreamResponse:
        if kind not in engine.release.has_route:  # 0.11: no such route, FastAPI's 404
            return json_response({"detail": "Not Found"}, status=404)
        if kind == "generate" and engine.release.generate_needs_scale_out and not engine.enable_scale_out:
            return json_response(SCALE_OUT_DISABLED, status=403)  # scale_out/factories.py
        return await handle_completion(engine, request, kind)

    return route


def _kv_event_sources(engine: EngineState) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /kv_event_sources``: each DP rank's ``KVEventsConfig`` keyed by the rank as a
    string, as vLLM answers it; ``{}`` when the engine publishes no events."""

    async def sources(request: web.Request) -> web.Response:
        publisher = engine.kv_publisher
        return json_response({} if publisher is None else {"0": publisher.config()})

    return sources


def add_routes(app: web.Application, engine: EngineState) -> None:
    """Every route of one engine: the generating ones, vLLM's control routes and the fake's ``/fake/*``."""
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
                "permission": [_permission(engine.created)],  # vLLM's ModelPermission, one per model
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
        app.router.add_post(path, _generating(engine, kind))
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/fake/stats", stats)
    if engine.release.minor >= (0, 31):  # vLLM's route from 0.31 on: 404 before
        app.router.add_get("/kv_event_sources", _kv_event_sources(engine))
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
    (``CacheConfig.metrics_info()``: ``__dict__`` in declaration order, every value as ``str()``
    writes it, then ``engine``), one series per data-parallel engine (the fake has one).

    ``num_gpu_blocks`` is the fake's ``kv_blocks``, ``block_size`` its block size, and
    ``enable_prefix_caching`` its prefix cache; the rest are the release's defaults, in its order
    (``vllm/config/cache.py`` of 0.11.0 and of 0.33.0). 0.33 adds labels that end in
    ``block_size`` (``hash_block_size`` reads ``"None"``: the API server never sets it) and
    ``kv_cache_size_tokens``, the capacity in tokens of this engine.
    """
    block, blocks = str(engine.kv.block_size), engine.load_model.kv_blocks
    prefix = str(engine.load_model.prefix_cache)
    fields = _fields_033(block, blocks, prefix) if engine.release.current else _fields_011(block, blocks, prefix)
    fields["engine"] = "0"
    labels = ",".join(f'{key}="{value}"' for key, value in fields.items())
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
    )


def _fields_011(block: str, blocks: int, prefix: str) -> dict[str, str]:
    return {
        "block_size": block, "gpu_memory_utilization": "0.9", "swap_space": "4", "cache_dtype": "auto",
        "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
        "enable_prefix_caching": prefix, "prefix_caching_hash_algo": "sha256", "cpu_offload_gb": "0",
        "calculate_kv_scales": "False", "kv_sharing_fast_prefill": "False", "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto", "num_gpu_blocks": str(blocks), "num_cpu_blocks": "None",
        "swap_space_bytes": "4294967296",
    }


def _fields_033(block: str, blocks: int, prefix: str) -> dict[str, str]:
    return {
        "block_size": block, "user_specified_block_size": "False", "kv_cache_layout": "NHD",
        "prefix_match_unit": "None", "gpu_memory_utilization": "0.92", "cache_dtype": "auto",
        "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
        "enable_prefix_caching": prefix, "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16", "use_replayssm": "False",
        "use_kda_recoverssm": "False", "num_gpu_blocks": str(blocks), "num_cpu_blocks": "None",
        "simple_cpu_offload_num_blocks": "None", "effective_attention_block_size": block,
        "kv_cache_size_tokens": str(blocks * int(block)), "kv_cache_max_concurrency": "None",
        "hash_block_size": "None", "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None", "kv_offloading_size": "None",
        "kv_offloading_backend": "native", "_block_size_resolved": "True",
    }
