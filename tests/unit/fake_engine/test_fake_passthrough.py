"""The fake engine's passthrough routes: vLLM's shapes, validation, records and faults."""

from __future__ import annotations

import base64
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, build_engine_app
from narwhal.fake_engine.passthrough import token_ids, vector

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


async def _client(aiohttp_client: ClientFactory) -> tuple[FakeEngine, TestClient[Any, Any]]:
    engine = FakeEngine("e0", max_model_len=4096)
    return engine, await aiohttp_client(build_engine_app(engine))


async def _post(client: TestClient[Any, Any], path: str, body: Any) -> tuple[int, Any]:
    resp = await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


async def test_tokenize_and_detokenize_shapes(aiohttp_client: ClientFactory) -> None:
    _, client = await _client(aiohttp_client)
    status, body = await _post(client, "/tokenize", {"model": "fake-model", "prompt": "a b c"})
    assert status == 200
    assert body == {"count": 3, "max_model_len": 4096, "tokens": token_ids("a b c"), "token_strs": None}
    status, body = await _post(client, "/tokenize", {"messages": [{"role": "user", "content": "x y"}],
                                                      "return_token_strs": True})
    assert (status, body["count"], body["token_strs"]) == (200, 2, ["x", "y"])
    status, body = await _post(client, "/detokenize", {"tokens": [5, 7]})
    assert (status, body) == (200, {"prompt": " t5 t7"})
    status, body = await _post(client, "/detokenize", {"tokens": ["x"]})
    assert status == 400 and body["error"]["code"] == 400


async def test_embeddings_and_pooling_are_openai_lists(aiohttp_client: ClientFactory) -> None:
    _, client = await _client(aiohttp_client)
    status, body = await _post(client, "/v1/embeddings", {"model": "fake-model", "input": ["one two", "three"]})
    assert status == 200
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("embd-") and body["object"] == "list" and body["model"] == "fake-model"
    assert body["data"] == [
        {"index": 0, "object": "embedding", "embedding": vector("one two")},
        {"index": 1, "object": "embedding", "embedding": vector("three")},
    ]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["total_tokens"] == 3
    status, body = await _post(client, "/v1/embeddings", {"input": "abc", "encoding_format": "base64"})
    packed = base64.b64decode(body["data"][0]["embedding"])
    assert status == 200 and struct.unpack("<8f", packed) == pytest.approx(vector("abc"), abs=1e-6)
    status, body = await _post(client, "/pooling", {"input": [[1, 2], [3]]})
    assert status == 200 and body["id"].startswith("pool-")
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"] and body["data"][0]["data"] == vector("1 2")
    status, body = await _post(client, "/v1/embeddings", {"input": {"bad": 1}})
    assert status == 400


async def test_score_and_rerank(aiohttp_client: ClientFactory) -> None:
    _, client = await _client(aiohttp_client)
    for path in ("/score", "/v1/score"):
        status, body = await _post(client, path, {"text_1": "q", "text_2": ["a", "b"]})
        assert status == 200 and body["object"] == "list"
        assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
        assert all(0 <= d["score"] < 1 for d in body["data"])
    for path in ("/rerank", "/v1/rerank"):
        status, body = await _post(client, path, {"query": "q", "documents": ["a", "b", "c"], "top_n": 2})
        assert status == 200 and set(body) == {"id", "model", "usage", "results"}
        scores = [r["relevance_score"] for r in body["results"]]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True)
        assert all(r["document"]["text"] in ("a", "b", "c") for r in body["results"])
    status, _ = await _post(client, "/rerank", {"query": "q"})
    assert status == 400


async def test_requests_are_recorded_and_unknown_models_are_404(aiohttp_client: ClientFactory) -> None:
    engine, client = await _client(aiohttp_client)
    status, body = await _post(client, "/tokenize", {"model": "nope", "prompt": "a"})
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    await _post(client, "/v1/rerank", {"query": "tag", "documents": ["d"]})
    recs = engine.get_records("tag")
    assert [(r["phase"], r["path"], r["outcome"], r["status"]) for r in recs] == [
        ("passthrough", "/v1/rerank", "completed", 200)
    ]


async def test_passthrough_faults_engine_wide_and_per_request(aiohttp_client: ClientFactory) -> None:
    engine, client = await _client(aiohttp_client)
    engine.set_faults({"passthrough": {"status": 503, "message": "down"}})
    status, body = await _post(client, "/tokenize", {"prompt": "a"})
    assert (status, body["error"]["message"], body["error"]["code"]) == (503, "down", 503)
    engine.clear_faults()
    status, body = await _post(client, "/tokenize", {"prompt": "a", "narwhal_fake": {"passthrough": {"status": 429}}})
    assert status == 429
    # Faults of the generation phases leave these routes alone.
    engine.set_faults({"decode": {"status": 500}, "prefill": {"status": 500}})
    status, _ = await _post(client, "/tokenize", {"prompt": "a"})
    assert status == 200
