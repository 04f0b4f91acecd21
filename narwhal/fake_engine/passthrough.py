"""vLLM's routes outside generation: tokenize, detokenize, embeddings, pooling, score, rerank.

Shapes follow vLLM's ``serving_tokenization.py``, ``serving_embedding.py``, ``serving_pooling.py``
and ``serving_score.py`` (their response models in ``protocol.py``):

* ``/tokenize`` (``prompt`` or chat ``messages``) → ``{"count", "max_model_len", "tokens",
  "token_strs"}``, ``token_strs`` null unless ``return_token_strs``;
* ``/detokenize`` (``tokens``) → ``{"prompt"}``;
* ``/v1/embeddings`` and ``/pooling`` (``input``: a string, strings, ids or lists of ids) →
  OpenAI's list shape, ``{"id", "object": "list", "created", "model", "data": [{"index",
  "object": "embedding" | "pooling", "embedding" | "data"}], "usage"}``; ``encoding_format:
  "base64"`` gives little-endian float32 bytes in base64, as vLLM does;
* ``/score`` and ``/v1/score`` (``text_1``, ``text_2``; one against many is broadcast) → list
  shape with ``{"index", "object": "score", "score"}``;
* ``/rerank`` and ``/v1/rerank`` (``query``, ``documents``, ``top_n``) → ``{"id", "model",
  "usage", "results": [{"index", "document": {"text"}, "relevance_score"}]}``, best first.

Numbers are a pure function of the text (a hash), so answers are deterministic and a test can
tell them apart. A token is a whitespace word, as in ``parse.count_prompt_tokens``. Every
request is recorded (phase ``"passthrough"``) and takes the ``passthrough`` fault spec, engine-
wide or per request (``narwhal_fake``): ``delay_headers_s``, then ``reset`` or ``status``.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from narwhal.fake_engine.emit import drop_connection, error_response
from narwhal.fake_engine.faults import RequestFaults, effective_spec
from narwhal.fake_engine.prefix import piece_ids, prompt_text
from narwhal.fake_engine.state import EngineState

RECORD_HEADERS = ("x-request-id", "authorization", "traceparent", "tracestate", "content-type")
DIMENSIONS = 8
VOCAB = 32000


class Invalid(Exception):
    """A request vLLM would refuse with 400."""


def _hash(text: str) -> int:
    return zlib.crc32(text.encode())


def _words(text: str) -> list[str]:
    return text.split()


def token_ids(text: str) -> list[int]:
    """The fake's token ids of ``text``: one per whitespace word, by hash, so stable across runs."""
    return [_hash(w) % VOCAB for w in _words(text)]


def _unit(text: str) -> float:
    return (_hash(text) % 10_000) / 10_000


def vector(text: str) -> list[float]:
    """A deterministic unit-range vector of ``text``: same text, same embedding."""
    return [round(_unit(f"{i}:{text}") * 2 - 1, 4) for i in range(DIMENSIONS)]


def _inputs(body: dict[str, Any]) -> list[str]:
    """``input`` as texts: ids become their decimal text (what the fake hashes)."""
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return value
        if all(type(v) is int for v in value):
            return [" ".join(map(str, value))]
        if all(isinstance(v, list) and all(type(t) is int for t in v) for v in value):
            return [" ".join(map(str, v)) for v in value]
    raise Invalid("`input` must be a string, a list of strings, a list of token ids or a list of lists of ids")


def _texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise Invalid(f"`{field}` must be a string or a non-empty list of strings")


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _encode(values: list[float], encoding: Any) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def tokenize(engine: EngineState, body: dict[str, Any], model: str, rid: str) -> dict[str, Any]:
    """``/tokenize``: a prompt or chat messages into ids (and ``token_strs`` when asked)."""
    if isinstance(body.get("prompt"), str):
        text = body["prompt"]
    elif isinstance(body.get("messages"), list):
        text = " ".join(m.get("content") or "" for m in body["messages"] if isinstance(m, dict)
                        and isinstance(m.get("content"), str))
    else:
        raise Invalid("`prompt` (a string) or `messages` is required")
    if engine.cache is not None:  # its tokens are the prefix cache's (what its KV events carry), template included
        chat = isinstance(body.get("messages"), list)
        pieces = piece_ids(prompt_text(body, chat, "chat" if chat else "completions"))
        return {"count": len(pieces), "max_model_len": engine.max_model_len, "tokens": pieces, "token_strs": None}
    tokens = token_ids(text)
    strs = _words(text) if body.get("return_token_strs") is True else None
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(engine: EngineState, body: dict[str, Any], model: str, rid: str) -> dict[str, Any]:
    """``/detokenize``: ids back into the fake's token texts."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise Invalid("`tokens` must be a list of non-negative integers")
    return {"prompt": "".join(f" t{t}" for t in tokens)}


def _pooled(kind: str, key: str, prefix: str) -> Callable[[EngineState, dict[str, Any], str, str], dict[str, Any]]:
    def handler(engine: EngineState, body: dict[str, Any], model: str, rid: str) -> dict[str, Any]:
        texts = _inputs(body)
        encoding = body.get("encoding_format")
        data = [{"index": i, "object": kind, key: _encode(vector(t), encoding)} for i, t in enumerate(texts)]
        return {"id": f"{prefix}-{rid}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": _usage(sum(len(_words(t)) for t in texts))}

    return handler


def score(engine: EngineState, body: dict[str, Any], model: str, rid: str) -> dict[str, Any]:
    """``/score``: a score per (``text_1``, ``text_2``) pair, one ``text_1`` broadcast."""
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise Invalid("`text_1` and `text_2` must have the same length, or `text_1` one item")
    data = [{"index": i, "object": "score", "score": _unit(a + "\x00" + b)}
            for i, (a, b) in enumerate(zip(first, second, strict=True))]
    tokens = sum(len(_words(a)) + len(_words(b)) for a, b in zip(first, second, strict=True))
    return {"id": f"score-{rid}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(tokens)}


def rerank(engine: EngineState, body: dict[str, Any], model: str, rid: str) -> dict[str, Any]:
    """``/rerank``: the documents best first, cut to ``top_n`` when it is set."""
    query = body.get("query")
    if not isinstance(query, str):
        raise Invalid("`query` must be a string")
    documents = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n") or 0
    if type(top_n) is not int or top_n < 0:
        raise Invalid("`top_n` must be a non-negative integer")
    scores = [_unit(query + "\x00" + d) for d in documents]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]
    tokens = sum(len(_words(query)) + len(_words(d)) for d in documents)
    return {"id": f"rerank-{rid}", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results[:top_n] if top_n else results}


HANDLERS: dict[str, Callable[[EngineState, dict[str, Any], str, str], dict[str, Any]]] = {
    "/tokenize": tokenize,
    "/detokenize": detokenize,
    "/v1/embeddings": _pooled("embedding", "embedding", "embd"),
    "/pooling": _pooled("pooling", "data", "pool"),
    "/score": score,
    "/v1/score": score,
    "/rerank": rerank,
    "/v1/rerank": rerank,
}


def _finish(rec: dict[str, Any], resp: web.Response, outcome: str) -> web.Response:
    rec["outcome"], rec["status"] = outcome, resp.status
    return resp


async def handle(engine: EngineState, request: web.Request) -> web.StreamResponse:
    """One passthrough request: record it, apply its faults, answer in vLLM's shape."""
    headers = {k: v for k in RECORD_HEADERS if (v := request.headers.get(k)) is not None}
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _finish(engine.record("passthrough", request.path, headers, None),
                       error_response(400, f"JSON decode error: {exc}"), "error")
    rec = engine.record("passthrough", request.path, headers, body)
    if not isinstance(body, dict):
        return _finish(rec, error_response(400, "The request body must be a JSON object."), "error")
    engine.active_requests += 1
    try:
        return await _answer(engine, request, body, rec)
    except asyncio.CancelledError:
        rec["outcome"] = "aborted"
        raise
    finally:
        engine.active_requests -= 1


async def _answer(
    engine: EngineState, request: web.Request, body: dict[str, Any], rec: dict[str, Any]
) -> web.StreamResponse:
    try:
        asked = RequestFaults.model_validate(body["narwhal_fake"]) if "narwhal_fake" in body else None
    except ValidationError as exc:
        return _finish(rec, error_response(400, f"invalid narwhal_fake: {exc}"), "error")
    spec = effective_spec(engine.faults.passthrough, asked.passthrough if asked else None, engine.name)
    if spec is not None and spec.delay_headers_s:
        await asyncio.sleep(spec.delay_headers_s)
    if spec is not None and spec.reset:
        rec["outcome"], rec["status"] = "reset", 0
        drop_connection(request, rst=True)
        return web.Response()
    if spec is not None and spec.status is not None:
        message = spec.message or f"fake engine fault: HTTP {spec.status}"
        return _finish(rec, error_response(spec.status, message, flat=spec.flat_error), "error")
    model = body.get("model") or engine.models[0]
    if model not in engine.models:
        resp = error_response(404, f"The model `{model}` does not exist.", err_type="NotFoundError", param="model")
        return _finish(rec, resp, "error")
    rid = request.headers.get("x-request-id") or engine.next_id()
    try:
        answer = HANDLERS[request.path](engine, body, model, rid)
    except Invalid as exc:
        return _finish(rec, error_response(400, str(exc)), "error")
    engine.completed_requests += 1
    return _finish(rec, web.Response(body=orjson.dumps(answer), content_type="application/json"), "completed")


def add_routes(app: web.Application, engine: EngineState) -> None:
    """Register every passthrough path on the engine's app."""
    async def route(request: web.Request) -> web.StreamResponse:
        return await handle(engine, request)

    for path in HANDLERS:
        app.router.add_post(path, route)
