"""Every generating route (completions, chat, messages, responses, generate): generation, the KV
handoff, and the faults. The endpoint decides only the bytes (``frames``), never the order below.

Order of events in one request, chosen to match what a router observes from vLLM:

1. parse and validate (4xx like vLLM), record the request, resolve the phase's fault spec;
2. ``delay_headers_s`` (a slow or queued engine), then ``reset`` (a crash: no response at all) or
   ``status`` (an HTTP error body);
3. streaming: headers go out at once (Starlette does so), then the consumer's KV pull — a failed
   pull is vLLM's ``kv_load_failure_policy="fail"``: an error event inside the 200 stream, then
   ``[DONE]`` — then the chat role chunk, ``delay_first_token_s`` (with heartbeats), the tokens
   (with ``token_delay_s``, ``silence_after``/``silence_s``, ``close_after``, ``stream_error``),
   the usage chunk and ``[DONE]``;
4. non-streaming: the same, except that every delay is spent before the one JSON answer, and a
   producer prefill holds its blocks and returns the descriptor in ``kv_transfer_params`` (a
   Responses ``failed`` fault: a 200 Response with ``"status": "failed"``, holding nothing).

A decode whose descriptor was never pulled tells the producer to free the blocks when aborted while
queued, as vLLM does for aborts before scheduling; when rejected (a ``status`` fault, or
validation) only on a release that frees refused handoffs (0.21.0 on, ``fake_engine.release``: 0.11
leaves them to the producer's timeout); a ``reset`` never does (a crashed engine notifies no one).

Invariant: each request's record gets exactly one outcome (``_State.done``) and a decode reads its
descriptor at most once (``pulled`` is set before the pull starts), whichever ``await`` an abort
lands on: the counters and held blocks that tests assert on stay exact. This module only orders
the events; how the bytes go out (faithful or coalesced writes) is ``emit.py``'s business.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from narwhal.fake_engine import frames_messages, kv, stream_handoff
from narwhal.fake_engine.admit import admit, release_unpulled
from narwhal.fake_engine.chunks import ChunkShape, StreamFrames, completion_body, token_text
from narwhal.fake_engine.emit import Emitter, drop_connection, error_response
from narwhal.fake_engine.faults import FaultSpec
from narwhal.fake_engine.frames import ID_PREFIX, frames_for
from narwhal.fake_engine.frames_responses import ResponsesFrames
from narwhal.fake_engine.parse import ParsedRequest, validation_error
from narwhal.fake_engine.state import EngineState
from narwhal.fake_engine.work import Work

KV_FAILED = "KV transfer failed"


def _wants_pull(req: ParsedRequest) -> bool:
    return req.kv_params is not None and req.kv_params.get("do_remote_prefill") is True


def _http_error(req: ParsedRequest, status: int, message: str, flat: bool) -> web.Response:
    # vLLM's Anthropic handler answers in Anthropic's shape; ``flat`` stands for its body
    # validation, which answers in OpenAI's.
    if req.kind == "messages" and not flat:
        return frames_messages.error_response(status, message)
    return error_response(status, message, flat=flat)


async def handle_completion(engine: EngineState, request: web.Request, kind: str) -> web.StreamResponse:
    """One request of a generating route ``kind``, in the order above; its record gets exactly one outcome."""
    admitted = await admit(engine, request, kind)
    if isinstance(admitted, web.Response):
        return admitted
    req, body, rec, spec = admitted

    engine.active_requests += 1
    state = _State(rec, Work.prepare(engine, req, body))
    state.streaming = req.stream
    if req.stream:
        engine.active_streams += 1
    try:
        early = await _before_work(engine, request, req, spec, state)
        if early is not None:
            return early
        if req.stream:
            return await _stream(engine, request, req, spec, state)
        return await _plain(engine, request, req, spec, state)
    except asyncio.CancelledError:
        state.aborted(engine, req)
        raise
    except ConnectionError:
        # The client went away and a write failed before cancellation reached us.
        state.aborted(engine, req)
        return state.resp if state.resp is not None else web.Response()
    finally:
        state.work.end(engine)
        engine.active_requests -= 1
        if state.streaming:
            engine.active_streams -= 1


class _State:
    """Per-request bookkeeping so that abort accounting knows what already happened."""

    __slots__ = ("rec", "pulled", "streaming", "done", "resp", "work")

    def __init__(self, rec: dict[str, Any], work: Work) -> None:
        self.rec = rec
        self.work = work
        self.resp: web.StreamResponse | None = None
        self.pulled = False
        self.streaming = False
        self.done = False

    def finish(self, engine: EngineState, outcome: str, status: int) -> None:
        self.done = True
        self.rec["outcome"] = outcome
        self.rec["status"] = status
        if outcome == "completed":
            engine.completed_requests += 1

    def aborted(self, engine: EngineState, req: ParsedRequest) -> None:
        if self.done:
            return
        self.done = True
        self.rec["outcome"] = "aborted"
        if self.streaming:
            engine.aborted_streams += 1
        if not self.pulled and _wants_pull(req):
            release_unpulled(engine, req.kv_params)


async def _before_work(
    engine: EngineState, request: web.Request, req: ParsedRequest, spec: FaultSpec, state: _State
) -> web.StreamResponse | None:
    """Faults that happen before any response byte: a response to return, or None to go on."""
    if spec.delay_headers_s:
        await asyncio.sleep(spec.delay_headers_s)
    if spec.reset:
        state.pulled = True  # a crashed engine notifies no producer
        state.finish(engine, "reset", 0)
        drop_connection(request, rst=True)
        return web.Response()
    if spec.status is not None:
        message = spec.message or f"fake engine fault: HTTP {spec.status}"
        if spec.validation:
            err = validation_error("fake_field", "value_error", message, "fault")
            resp = error_response(400, err.message, err_type=err.err_type, param=err.param)
        else:
            resp = _http_error(req, spec.status, message, spec.flat_error)
        state.finish(engine, "error", spec.status)
        if _wants_pull(req):
            state.pulled = True
            if not spec.validation:
                _refused(engine, request, req)
        return resp
    return None


def _plan(engine: EngineState, req: ParsedRequest, spec: FaultSpec) -> tuple[int, str]:
    """How many tokens this request generates and the finish reason of the last one. A
    continuation (``req.start`` > 0) ends where the unbroken stream would have: ``tokens`` and
    the engine's default count the whole output, ``max_tokens`` what is left of it."""
    if spec.tokens is not None:
        n = spec.tokens - req.start
    elif req.max_tokens is not None:
        n = req.max_tokens
    else:
        n = engine.default_tokens - req.start
    n = max(n, 0)
    finish = "length" if req.max_tokens is not None and n >= req.max_tokens else "stop"
    return n, finish


def _meets(at: int | None, start: int) -> bool:
    """Does a fault at token index ``at`` (of the whole output) fall in this request's part of
    it? A continuation meets only the faults past its first token: the one that cut the stream
    it continues is behind it."""
    return at is not None and (at > start or start == 0)


def _response_id(request: web.Request, engine: EngineState, req: ParsedRequest) -> str:
    if req.kind == "responses":  # this path reads the body's request_id, not X-Request-Id
        return req.request_id or "resp_" + engine.next_id()
    # vLLM builds its request id from X-Request-Id when the client sends one.
    base = request.headers.get("x-request-id") or req.request_id or engine.next_id()
    return ID_PREFIX[req.kind] + base


def _frames(request: web.Request, engine: EngineState, req: ParsedRequest) -> StreamFrames:
    rid = _response_id(request, engine, req)
    shape = ChunkShape(engine.release.current, req.prompt_tokens if req.continuous_usage else None,
                       engine.release.since_033, start=req.start)
    return frames_for(req.kind, engine.templates(req.model), rid, int(time.time()), req.max_tokens, shape)


async def _pull_for(engine: EngineState, request: web.Request, req: ParsedRequest, state: _State) -> bool:
    """The consumer's KV pull when the request is a decode with a descriptor; False: it failed."""
    if not _wants_pull(req):
        return True
    assert req.kv_params is not None
    state.pulled = True  # set first: an abort mid-pull must not trigger a second read
    return await kv.consumer_pull(engine, _pull_params(request, engine, req))


def _pull_params(request: web.Request, engine: EngineState, req: ParsedRequest) -> dict[str, Any]:
    """The descriptor to pull by. A 0.11 descriptor names no ``remote_request_id``: that release's
    consumer notifies the producer under its *own* request id, which matches the producer's only
    because a router sends both legs the same ``X-Request-Id`` (vLLM's own P/D proxy, which sends both legs one id)."""
    params = req.kv_params
    assert params is not None
    if "remote_request_id" in params:
        return params
    return {**params, "remote_request_id": _response_id(request, engine, req) + "-0"}


def _refused(engine: EngineState, request: web.Request, req: ParsedRequest) -> None:
    """The serving layer refused a decode (4xx, or an error answer before the engine took it):
    0.21.0 and later tell the producer to free the handoff's blocks
    (``_with_kv_transfer_rejection_cleanup``) except on ``/inference/v1/generate``, whose handler
    it does not wrap; 0.11 does not, and they wait for its timeout."""
    if engine.release.frees_refused and req.kind != "generate" and _wants_pull(req):
        release_unpulled(engine, _pull_params(request, engine, req))


async def _stream(
    engine: EngineState, request: web.Request, req: ParsedRequest, spec: FaultSpec, state: _State
) -> web.StreamResponse:
    n, finish = _plan(engine, req, spec)
    frames = _frames(request, engine, req)

    out = Emitter(request, state, engine.coalesce)
    await out.start()
    if not await _pull_for(engine, request, req, state):
        await out.emit(frames.error(500, KV_FAILED, False))
        return _stream_end(engine, state, await out.finish(), "error")

    cached = await state.work.run(engine, req)
    prompt = req.prompt_tokens
    opening = frames.opening(prompt)
    if opening:
        await out.emit(opening)
    if spec.done_before_token:
        await out.emit(frames.terminal_first())
        return _stream_end(engine, state, await out.finish(), "completed")
    if spec.empty or n == 0:
        await out.emit(frames.empty_end(prompt, req.include_usage, cached))
        return _stream_end(engine, state, await out.finish(), "completed", hold=req)
    if spec.delay_first_token_s:
        await out.pause(spec.delay_first_token_s, spec.heartbeat_s, frames.heartbeat(prompt, 0))

    handed = stream_handoff.with_handoff(engine, req, frames, _response_id(request, engine, req))
    stop = await _emit_tokens(engine, out, spec, handed or frames, req, n, finish)
    if stop == "error":
        err = spec.stream_error
        assert err is not None
        await out.emit(frames.error(err.code, err.message, err.flat))
        return _stream_end(engine, state, await out.finish(), "error")
    if stop == "close":
        resp = await out.flush()
        state.finish(engine, "closed", 200)
        drop_connection(request, rst=False)
        return resp
    state.work.generated(engine, req, n)
    await out.emit(frames.end(prompt, n, req.include_usage, finish, cached))
    return _stream_end(engine, state, await out.finish(), "completed", hold=None if handed else req)


async def _emit_tokens(
    engine: EngineState, out: Emitter, spec: FaultSpec, frames: StreamFrames, req: ParsedRequest, n: int,
    finish: str,
) -> str | None:
    """Send tokens ``req.start`` … ``req.start + n - 1`` with their pauses: the fault that stopped
    it (``"error"`` or ``"close"``), or None when all went out. Fault indices count the whole
    output (``_meets``)."""
    token_delay = spec.token_delay_s if spec.token_delay_s is not None else engine.token_delay_s
    hb_s = spec.heartbeat_s
    start, prompt = req.start, req.prompt_tokens
    err_at = close_at = silence_at = -1
    if spec.stream_error is not None and _meets(spec.stream_error.after, start):
        err_at = spec.stream_error.after
    if spec.close_after is not None and _meets(spec.close_after, start):
        close_at = spec.close_after
    if spec.silence_after is not None and spec.silence_s and _meets(spec.silence_after, start):
        silence_at = spec.silence_after
    end = start + n
    last = end - 1
    for i in range(start, end):
        if i == err_at:
            return "error"
        if i == close_at:
            return "close"
        if i > start and token_delay:
            await out.pause(token_delay, None, b"")
        if i == silence_at:
            await out.pause(spec.silence_s, hb_s, frames.heartbeat(prompt, i - start))
        if i < spec.reasoning and i != last:
            await out.emit(frames.reasoning(i))
        else:
            await out.emit(frames.last_token(i, finish) if i == last else frames.token(i))
    if err_at >= end:  # a fault past the last token comes after it
        return "error"
    return "close" if close_at >= end else None


def _stream_end(
    engine: EngineState,
    state: _State,
    resp: web.StreamResponse,
    outcome: str,
    hold: ParsedRequest | None = None,
) -> web.StreamResponse:
    """A stream that sent its ``[DONE]``; ``hold`` is a request that finished generating."""
    engine.completed_streams += 1
    state.finish(engine, outcome, 200)
    if hold is not None and hold.kv_params is not None and hold.kv_params.get("do_remote_decode") is True:
        # A streamed producer prefill before 0.33 still pins its blocks, but no descriptor
        # reaches anyone (a real 0.32 engine puts none in its chunks): they wait for the lease.
        engine.kv.allocate(engine.kv.unique_request_id(engine.next_id()), hold.prompt_tokens)
    return resp


async def _plain(
    engine: EngineState, request: web.Request, req: ParsedRequest, spec: FaultSpec, state: _State
) -> web.StreamResponse:
    if not await _pull_for(engine, request, req, state):
        state.finish(engine, "error", 500)
        return _http_error(req, 500, KV_FAILED, False)
    cached = await state.work.run(engine, req)
    n, finish = _plan(engine, req, spec)
    token_delay = spec.token_delay_s if spec.token_delay_s is not None else engine.token_delay_s
    produced = n
    if spec.close_after is not None and spec.close_after < n:
        produced = spec.close_after
    # Non-streaming: the whole generation time is spent before the single answer.
    busy = spec.delay_first_token_s + max(produced - 1, 0) * token_delay
    if spec.silence_after is not None and spec.silence_after < produced:
        busy += spec.silence_s
    if busy:
        await asyncio.sleep(busy)
    if spec.close_after is not None:
        state.finish(engine, "closed", 0)
        drop_connection(request, rst=False)
        return web.Response()
    if spec.stream_error is not None:
        err = spec.stream_error
        status = err.code if err.code is not None else 500
        state.finish(engine, "error", status)
        return _http_error(req, status, err.message, err.flat)

    if spec.failed is not None and isinstance(frames := _frames(request, engine, req), ResponsesFrames):
        # A Responses server reports a failed generation in a 200 (no descriptor, no blocks held).
        state.finish(engine, "error", 200)
        body = frames.failed(spec.failed.code, spec.failed.message)
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    if spec.empty or spec.done_before_token or n == 0:
        text, finish, n = "", "stop", 0
    else:
        text = "".join([token_text(i) for i in range(req.start, req.start + n)])
    state.work.generated(engine, req, n)
    rid = _response_id(request, engine, req)
    if req.kind in ("chat", "completions"):
        body = completion_body(
            req.chat, rid, int(time.time()), req.model, text, finish, req.prompt_tokens, n, cached_tokens=cached
        )
    else:
        body = frames_for(req.kind, engine.templates(req.model), rid, int(time.time()), req.max_tokens).body(
            text, finish, req.prompt_tokens, n, cached)
    if req.kind == "responses" and not engine.release.hands_off_on_responses:
        descriptor: Any = kv.MISSING  # 0.11's Responses take no kv_transfer_params: none answered
    else:
        descriptor = kv.producer_descriptor(engine, req.kv_params, rid, req.prompt_tokens, spec.descriptor,
                                            cached or 0)
    if descriptor is kv.MISSING or (descriptor is None and req.kind == "messages"):
        body.pop("kv_transfer_params", None)  # Messages are dumped with exclude_none: absent, not null
    else:
        body["kv_transfer_params"] = descriptor
        state.rec["answer_kv"] = descriptor  # what the router must forward byte for byte (tests read it)
    state.finish(engine, "completed", 200)
    return web.Response(body=orjson.dumps(body), content_type="application/json")
