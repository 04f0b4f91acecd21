"""A generating request's first step in the fake engine: parse and validate it as vLLM does,
record it, and resolve the fault spec of its phase (``fake_engine.generate``'s step 1).

Invariant: a request refused here (not JSON, or a 4xx of vLLM's validation) is recorded with its
outcome, ``error``, and its status, and a decode refused in the handler gives its handoff back
exactly when the imitated release does (0.21.0 on, not on ``/inference/v1/generate``,
``fake_engine.release``); one admitted carries its parsed form, its record and its spec on.
Why a module of its own: the order of the events after admission (``generate``) is a question
apart from what vLLM accepts.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from narwhal.fake_engine import continuation, kv
from narwhal.fake_engine.emit import error_response
from narwhal.fake_engine.faults import FaultSpec, effective_spec
from narwhal.fake_engine.parse import ParsedRequest, RequestError, detect_phase, parse_request
from narwhal.fake_engine.parse_endpoints import parse_endpoint_request
from narwhal.fake_engine.state import EngineState

NO_SPEC = FaultSpec()
RECORD_HEADERS = ("x-request-id", "authorization", "x-api-key", "traceparent", "tracestate", "content-type")

Admitted = tuple[ParsedRequest, dict[str, Any], dict[str, Any], FaultSpec]  # parsed, body, record, spec


def release_unpulled(engine: EngineState, params: Any) -> None:
    """Tell the producer a handoff will not be read (its blocks freed), as a refusing vLLM does."""
    if isinstance(params, dict) and params.get("do_remote_prefill") is True and kv.pull_target(params):
        engine.spawn(kv.pull(engine, params))


def _parse(body: Any, kind: str, models: list[str], max_model_len: int, current: bool) -> ParsedRequest:
    if kind in ("chat", "completions"):
        return parse_request(body, kind == "chat", models, max_model_len, current)
    return parse_endpoint_request(body, kind, models, max_model_len, current)


def _fail(rec: dict[str, Any], resp: web.Response) -> web.Response:
    rec["outcome"] = "error"
    rec["status"] = resp.status
    return resp


async def admit(engine: EngineState, request: web.Request, kind: str) -> Admitted | web.Response:
    """The request parsed, recorded and its fault spec resolved; or the refusal, recorded."""
    if engine.port is None:
        # In-process test servers never tell the engine its port: learn it from the socket.
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if sockname:
            engine.port = sockname[1]
    headers = {k: v for k in RECORD_HEADERS if (v := request.headers.get(k)) is not None}
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        engine.count_request("decode")
        rec = engine.record("decode", request.path, headers, None)
        return _fail(rec, error_response(400, f"JSON decode error: {exc}"))
    try:
        req = _parse(body, kind, engine.models, engine.max_model_len, engine.release.current)
    except RequestError as err:
        phase = detect_phase(body) if isinstance(body, dict) else "decode"
        engine.count_request(phase)
        rec = engine.record(phase, request.path, headers, body)
        # fake_engine.release: from 0.21.0, inside the chat, completions and responses handlers only.
        if isinstance(body, dict) and engine.release.frees_refused and not err.validation and kind != "generate":
            release_unpulled(engine, body.get("kv_transfer_params"))
        return _fail(rec, error_response(err.status, err.message, err_type=err.err_type, param=err.param))
    req.start = continuation.start_of(kind, body)
    engine.count_request(req.phase)
    rec = engine.record(req.phase, request.path, headers, body)
    request_spec = None
    if req.faults is not None:
        request_spec = req.faults.prefill if req.phase == "prefill" else req.faults.decode
    spec = effective_spec(engine.faults.for_phase(req.phase), request_spec, engine.name) or NO_SPEC
    if spec.streams_only and not req.stream:
        spec = NO_SPEC
    return req, body, rec, spec
