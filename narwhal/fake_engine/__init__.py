"""A fake vLLM engine that speaks the disaggregated (prefill/decode) wire format (docs/behaviour.md "Fake engines").

Why it exists: the router's hard cases — a producer whose KV blocks stay pinned, a consumer that
cannot read them, a stream that stalls, errors inside HTTP 200 streams, malformed descriptors —
are rare on real GPUs and impossible to trigger on demand. The fake imitates vLLM's OpenAI server
and NixlConnector faithfully (see vLLM's OpenAI server and NixlConnector) and lets tests inject each fault per
engine or per request, while staying cheap enough for the perf suite.

Engine routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/messages``,
``POST /v1/responses``, ``POST /inference/v1/generate`` (vLLM's `vllm/entrypoints/` for each route), ``GET /health``,
``/version``, ``/v1/models``, ``/load``, ``/metrics``, ``/fake/stats``, ``POST /fake/kv/read``, and
the passthrough routes ``POST /tokenize``, ``/detokenize``, ``/v1/embeddings``, ``/pooling``,
``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank`` (``passthrough.py``).

Control routes (fleet process): ``GET /engines``, ``GET /engines/{name}/stats``,
``GET|DELETE /engines/{name}/requests`` (``?contains=`` filters on the compact JSON of the body),
``GET|PUT|DELETE /engines/{name}/faults``, ``GET|PUT /engines/{name}/model`` (the load and cache
models, ``state.EngineModel``; a PUT changes the keys it names), ``GET|PUT|DELETE
/engines/{name}/background`` (``{"requests": N, "hold_s": S}``: load served for someone else),
``POST /engines/{name}/stop|start`` (``start?restart=1``: as a new process, a new engine id and an
empty prefix cache; ``&version=V``: of another release; ``&scale_out=0|1``: without or with
``--enable-scale-out``), ``POST /reset`` (also stops background load).

Load and cache models (docs/behaviour.md "Fake engines"), each off by default (``--max-num-seqs``,
``--prefill-s-per-token``,
``--prefix-cache``, ``--kv-blocks``): a batch limit with FIFO waiting and background load
(``batch``), a prefix cache of chained 16-token blocks (``prefix``; a token is then 4 characters of
the prompt), a prefill cost per uncached token on one prefill lane, all applied per request by
``work`` and reported by ``/metrics`` in vLLM's names.

Per-request faults: the body key ``narwhal_fake: {"prefill": FaultSpec, "decode": FaultSpec,
"passthrough": FaultSpec}``.

Invariant: the package imports nothing else from ``narwhal`` (it shares no wire code with the
router it tests, so a router bug cannot hide in both), and its modules import only downward, so
there is no import cycle (``tests/unit/fake_engine/test_fake_engine_layout.py`` checks both). It
imitates vLLM 0.33 by default and 0.32, 0.21, 0.11 on demand, judged by real engines in
``tests/real_vllm/test_real_shapes.py``. Its modules, from the bottom:

- ``faults.py``: fault specs, per engine and per request
- ``chunks.py``: vLLM's frames, pre-encoded
- ``kvstore.py``: held KV blocks and their leases
- ``prefix.py``: the prefix cache of chained 16-token blocks
- ``batch.py``: batch slots, the prefill lane, background load
- ``histogram.py``: vLLM's request-phase histograms on ``/metrics``
- ``release.py``: each release's descriptor keys, block ids, labels, routes, refusal cleanup
- ``frames_messages.py``, ``frames_responses.py``, ``frames_generate.py``: each endpoint's frames
- ``frames.py``: which frames a request is written with
- ``parse.py``: vLLM-like validation; ``parse_endpoints.py``: the other endpoints' fields
- ``emit.py``: SSE writes, error bodies, dropped connections
- ``kv_events.py``: the KV-cache event publisher (ZMQ, replay, ``/kv_event_sources``)
- ``state.py``: ``EngineState``, one engine's state, and the registry of engines by id
- ``kv.py``: the descriptor and the pull: the KV handoff
- ``stream_handoff.py``: a 0.33 streamed prefill's handoff on its last chunk
- ``work.py``: a request's slot, cache lookup and prefill cost
- ``admit.py``: a generating request parsed, validated, recorded, its fault spec resolved
- ``continuation.py``: where a continued output starts, so it carries on exactly
- ``generate.py``: every generating route: the order of its events and its faults
- ``passthrough.py``: tokenize, embeddings, score …
- ``routes.py``: the engine's routes
- ``engine.py``: ``FakeEngine``, an ``EngineState`` that listens, and ``build_engine_app``
- ``control.py``: the fleet's control app
- ``fleet.py``: the fleet process and its CLI
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
