"""The fake engine's /v1/messages, /v1/responses and /inference/v1/generate, against what vLLM
sends (vLLM's `vllm/entrypoints/` for each route): event names and order, field names, error shapes, and
``kv_transfer_params`` present or absent exactly as vLLM writes it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]
KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
      "remote_host": None, "remote_port": None}
MESSAGE = {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "one two three"}]}
RESPONSE = {"model": "fake-model", "max_output_tokens": 2, "input": "one two", "request_id": "resp_abc"}
GENERATE = {"model": "fake-model", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}




def events(raw: bytes) -> list[tuple[str | None, Any]]:
    out: list[tuple[str | None, Any]] = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        name, data = None, b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        out.append((name, "[DONE]" if data == b"[DONE]" else orjson.loads(data)))
    return out


async def test_messages_stream_follows_vllms_converter(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/messages", json={**MESSAGE, "stream": True}, headers={"X-Request-Id": "r1"})
    assert resp.status == 200
    got = events(await resp.read())
    assert [n for n, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                   "content_block_delta", "content_block_delta", "content_block_stop",
                                   "message_delta", "message_stop", None]
    assert got[0][1]["message"]["id"] == "chatcmpl-r1" and got[0][1]["message"]["usage"]["input_tokens"] == 3
    assert [d["delta"]["text"] for n, d in got if n == "content_block_delta"] == [" t0", " t1", " t2"]
    assert got[6][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                         "usage": {"input_tokens": 3, "output_tokens": 3}}
    assert got[-1] == (None, "[DONE]")


async def test_messages_kv_transfer_params_is_absent_not_null_without_a_descriptor(
    client: TestClient[Any, Any], engine: FakeEngine
) -> None:
    plain = await (await client.post("/v1/messages", json=MESSAGE)).json()
    assert "kv_transfer_params" not in plain and plain["type"] == "message"
    prefill = await (await client.post("/v1/messages", json={**MESSAGE, "max_tokens": 1,
                                                             "kv_transfer_params": KV})).json()
    assert prefill["kv_transfer_params"]["remote_engine_id"] == engine.engine_id
    assert prefill["stop_reason"] == "max_tokens"


async def test_messages_errors_in_both_shapes(client: TestClient[Any, Any]) -> None:
    fake = {"decode": {"stream_error": {"code": 503, "message": "busy", "after": 1}}}
    got = events(await (await client.post("/v1/messages", json={**MESSAGE, "stream": True,
                                                                "narwhal_fake": fake})).read())
    assert got[-2] == ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    assert got[-1] == (None, "[DONE]") and "message_stop" not in [n for n, _ in got]
    resp = await client.post("/v1/messages", json={**MESSAGE, "narwhal_fake": {"decode": {"status": 429}}})
    assert resp.status == 429
    assert (await resp.json())["error"]["type"] == "rate_limit_error"
    resp = await client.post("/v1/messages", json={**MESSAGE, "max_tokens": 0})
    assert resp.status == 400 and set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_responses_stream_and_sequence_numbers(client: TestClient[Any, Any]) -> None:
    got = events(await (await client.post("/v1/responses", json={**RESPONSE, "stream": True})).read())
    assert [n for n, _ in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete",  # cut: 0.33's event
    ]
    assert [d["sequence_number"] for _, d in got] == list(range(10))
    assert got[0][1]["response"]["kv_transfer_params"] is None and got[0][1]["response"]["id"] == "resp_abc"
    final = got[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_responses_prefill_is_incomplete_with_its_descriptor(client: TestClient[Any, Any]) -> None:
    plain = await (await client.post("/v1/responses", json=RESPONSE)).json()
    assert "kv_transfer_params" in plain and plain["kv_transfer_params"] is None
    prefill = await (await client.post("/v1/responses", json={**RESPONSE, "max_output_tokens": 1,
                                                              "kv_transfer_params": KV})).json()
    assert prefill["status"] == "incomplete" and prefill["kv_transfer_params"]["do_remote_prefill"] is True


async def test_responses_stream_errors(client: TestClient[Any, Any]) -> None:
    fake = {"decode": {"stream_error": {"code": 500, "message": "boom", "after": 1}}}
    got = events(await (await client.post("/v1/responses", json={**RESPONSE, "stream": True,
                                                                 "narwhal_fake": fake})).read())
    assert got[-1][0] == "error" and got[-1][1]["code"] == 500 and got[-1][1]["message"] == "boom"
    fake["decode"]["stream_error"]["flat"] = True
    got = events(await (await client.post("/v1/responses", json={**RESPONSE, "stream": True,
                                                                 "narwhal_fake": fake})).read())
    assert got[-1][0] == "response.failed" and got[-1][1]["response"]["error"] == {"code": 500, "message": "boom"}


async def test_a_failed_responses_answer_is_a_200_without_a_descriptor(
    client: TestClient[Any, Any], engine: FakeEngine
) -> None:
    fake = {"prefill": {"failed": {"code": 503, "message": "generation failed"}}}
    resp = await client.post("/v1/responses", json={**RESPONSE, "max_output_tokens": 1, "kv_transfer_params": KV,
                                                    "narwhal_fake": fake})
    assert resp.status == 200
    body = await resp.json()
    assert body["status"] == "failed" and body["error"] == {"code": 503, "message": "generation failed"}
    assert body["kv_transfer_params"] is None and body["id"] == "resp_abc"
    assert engine.kv.held_blocks == 0  # a failed prefill holds nothing


async def test_generate_frames_and_body(client: TestClient[Any, Any]) -> None:
    got = events(await (await client.post("/inference/v1/generate", json={**GENERATE, "stream": True},
                                          headers={"X-Request-Id": "g1"})).read())
    assert got == [
        (None, {"request_id": "generate-tokens-g1", "choices": [{"index": 0, "logprobs": None,
                                                                 "finish_reason": None, "token_ids": [1000]}]}),
        (None, {"request_id": "generate-tokens-g1", "choices": [{"index": 0, "logprobs": None,
                                                                 "finish_reason": "length", "token_ids": [1001]}]}),
        (None, "[DONE]"),
    ]
    body = await (await client.post("/inference/v1/generate", json=GENERATE)).json()
    assert body["kv_transfer_params"] is None and body["choices"][0]["token_ids"] == [1000, 1001]
    resp = await client.post("/inference/v1/generate", json={**GENERATE, "sampling_params": {"max_tokens": 1,
                                                                                             "min_tokens": 2}})
    assert resp.status == 400
