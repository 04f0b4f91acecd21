"""A fake vLLM engine that speaks the disaggregated (prefill/decode) wire format (SPEC §9).

Why it exists: the router's hard cases — a producer whose KV blocks stay pinned, a consumer that
cannot read them, a stream that stalls, errors inside HTTP 200 streams, malformed descriptors —
are rare on real GPUs and impossible to trigger on demand. The fake imitates vLLM's OpenAI server
and NixlConnector faithfully (see VLLM-PROTOCOL.md section A) and lets tests inject each fault per
engine or per request, while staying cheap enough for the perf suite.

Engine routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health``,
``/version``, ``/v1/models``, ``/load``, ``/metrics``, ``/fake/stats``, ``POST /fake/kv/read``.

Control routes (fleet process): ``GET /engines``, ``GET /engines/{name}/stats``,
``GET|DELETE /engines/{name}/requests`` (``?contains=`` filters on the compact JSON of the body),
``GET|PUT|DELETE /engines/{name}/faults``, ``POST /engines/{name}/stop|start``, ``POST /reset``.

Per-request faults: the body key ``narwhal_fake: {"prefill": FaultSpec, "decode": FaultSpec}``.

Modules: ``faults`` (specs), ``chunks`` (pre-encoded frames), ``parse`` (vLLM-like validation),
``kvstore`` (held blocks, leases), ``state`` (engine state), ``kv`` (descriptor, pull, side
channel), ``generate`` (completions), ``routes`` (small routes), ``engine`` (listener + app),
``control`` (control app), ``fleet`` (process + CLI).
"""

from __future__ import annotations

from narwhal.fake_engine.control import build_control_app
from narwhal.fake_engine.engine import FakeEngine, build_engine_app
from narwhal.fake_engine.faults import EngineFaults, FaultSpec, RequestFaults, StreamError
from narwhal.fake_engine.fleet import Fleet, main, run_fleet

__all__ = [
    "EngineFaults",
    "FakeEngine",
    "FaultSpec",
    "Fleet",
    "RequestFaults",
    "StreamError",
    "build_control_app",
    "build_engine_app",
    "main",
    "run_fleet",
]
