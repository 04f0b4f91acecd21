"""Tests of the fake vLLM engine: wire format, KV handoff imitation, faults, stats, fleet CLI."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, Fleet, build_engine_app

PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
ROOT = Path(__file__).resolve().parents[3]

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def prefill_body(n_words: int = 40, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "fake-model",
        "prompt": words(n_words),
        "stream": False,
        "max_tokens": 1,
        "ignore_eos": True,
        "kv_transfer_params": dict(PREFILL_KV),
    }
    body.update(extra)
    return body


def events(raw: bytes) -> list[str]:
    """SSE data payloads, in order (the fake never splits an event)."""
    assert raw.endswith(b"\n\n") or raw == b""
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            out.append(block[len("data: ") :])
    return out


def decoded(raw: bytes) -> list[Any]:
    return [e if e == "[DONE]" else json.loads(e) for e in events(raw)]


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine("e0")


@pytest.fixture
async def client(aiohttp_client: ClientFactory, engine: FakeEngine) -> TestClient[Any, Any]:
    return await aiohttp_client(build_engine_app(engine))


# -- wire format -------------------------------------------------------------------------------


async def test_completions_stream_wire_format(client: TestClient[Any, Any]) -> None:
    body = {"model": "fake-model", "prompt": "a b c", "max_tokens": 3, "stream": True}
    body["stream_options"] = {"include_usage": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.read()
    evs = decoded(raw)
    assert evs[-1] == "[DONE]"
    tokens = evs[:3]
    first = tokens[0]
    assert first["id"].startswith("cmpl-") and first["object"] == "text_completion"
    assert isinstance(first["created"], int) and first["model"] == "fake-model"
    assert first["usage"] is None
    assert first["choices"] == [
        {"index": 0, "text": " t0", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]
    assert [t["choices"][0]["text"] for t in tokens] == [" t0", " t1", " t2"]
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, "length"]
    assert evs[3]["choices"] == [] and evs[3]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert len(evs) == 5
    # Exact bytes of a token frame: what routers relay without re-encoding.
    assert raw.split(b"\n\n")[1] == (
        b'data: {"id":"'
        + first["id"].encode()
        + b'","object":"text_completion","created":'
        + str(first["created"]).encode()
        + b',"model":"fake-model","choices":[{"index":0,"text":" t1","logprobs":null,'
        b'"finish_reason":null,"stop_reason":null}],"usage":null}'
    )


async def test_chat_stream_wire_format(client: TestClient[Any, Any]) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}], "stream": True}
    resp = await client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 2})
    evs = decoded(await resp.read())
    assert evs[0]["object"] == "chat.completion.chunk" and evs[0]["id"].startswith("chatcmpl-")
    assert evs[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert evs[1]["choices"][0]["delta"] == {"content": " t0"}
    assert evs[1]["choices"][0]["finish_reason"] is None
    assert evs[2]["choices"][0]["delta"] == {"content": " t1"}
    assert evs[2]["choices"][0]["finish_reason"] == "length"
    assert evs[3:] == ["[DONE]"]


async def test_non_streaming_bodies(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": ["a b", "c"], "max_tokens": 4}
    )
    data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == " t0 t1 t2 t3"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens"] == 3 and data["usage"]["completion_tokens"] == 4
    assert "kv_transfer_params" in data and data["kv_transfer_params"] is None

    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x y"}]}]}
    resp = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "abc"})
    data = await resp.json()
    assert data["id"] == "chatcmpl-abc" and data["object"] == "chat.completion"
    # No max_tokens: the engine default (16) and a natural stop.
    assert data["choices"][0]["message"]["content"] == "".join(f" t{i}" for i in range(16))
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["prompt_tokens"] == 2
    # Token-id prompts count their length.
    resp = await client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4]], "max_tokens": 1})
    assert (await resp.json())["usage"]["prompt_tokens"] == 4


async def test_validation_errors_like_vllm(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    resp = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert resp.status == 404
    assert await resp.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    bad = [
        {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
        {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
        {"prompt": "x", "narwhal_fake": {"decode": {"no_such_fault": 1}}},
        {"prompt": "x", "narwhal_fake": {"decode": {"descriptor": "weird"}}},
        {"max_tokens": 2},
    ]
    for body in bad:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 400, body
        err = (await resp.json())["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] is None
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream_options": {}})
    assert "Stream options can only be defined when `stream=True`." in (await resp.json())["error"]["message"]
    resp = await client.post(
        "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert all(r["outcome"] == "error" for r in engine.get_records())


async def test_operational_routes(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    resp = await client.get("/health")
    assert resp.status == 200 and await resp.read() == b""
    assert await (await client.get("/version")).json() == {"version": "0.11.0"}
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    entry = models["data"][0]
    assert entry["id"] == entry["root"] == "fake-model" and entry["owned_by"] == "vllm"
    assert entry["parent"] is None and entry["max_model_len"] == 8192 and entry["permission"] == []
    assert await (await client.get("/load")).json() == {"server_load": 0}
    text = await (await client.get("/metrics")).text()
    assert 'vllm:num_requests_running{engine="0",model_name="fake-model"} 0.0' in text

    engine.set_faults({"health_status": 503, "version": "0.9.9", "models": ["m1", "m2"]})
    resp = await client.get("/health")
    assert resp.status == 503 and await resp.read() == b""
    assert (await (await client.get("/version")).json())["version"] == "0.9.9"
    assert [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]] == ["m1", "m2"]
    assert (await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})).status == 404
    resp = await client.post("/v1/completions", json={"model": "m2", "prompt": "x", "max_tokens": 1})
    assert (await resp.json())["model"] == "m2"
    engine.clear_faults()
    assert (await client.get("/health")).status == 200


# -- KV handoff --------------------------------------------------------------------------------


async def test_prefill_descriptor_and_held_blocks(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    resp = await client.post("/v1/completions", json=prefill_body(40), headers={"X-Request-Id": "r1"})
    data = await resp.json()
    assert data["choices"][0]["text"] == " t0"
    desc = data["kv_transfer_params"]
    assert desc == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1]],
        "remote_engine_id": engine.engine_id,
        "remote_request_id": "cmpl-r1-0",
        "remote_host": "127.0.0.1",
        "remote_port": client.server.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }
    # A short prompt: an empty block list, still a held entry; a reused request id stays unique.
    resp = await client.post("/v1/completions", json=prefill_body(5), headers={"X-Request-Id": "r1"})
    desc2 = (await resp.json())["kv_transfer_params"]
    assert desc2["remote_block_ids"] == [[]] and desc2["remote_request_id"] != "cmpl-r1-0"
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": words(33)}],
            "max_tokens": 1,
            "kv_transfer_params": dict(PREFILL_KV),
        },
    )
    assert (await resp.json())["kv_transfer_params"]["remote_block_ids"] == [[2, 3]]
    stats = await (await client.get("/fake/stats")).json()
    assert stats["held_blocks"] == 4 and stats["held_requests"] == 3
    assert stats["requests"] == {"prefill": 3, "decode": 0, "total": 3}
    assert stats["engine_id"] == engine.engine_id and stats["name"] == "e0"
    assert stats["url"] == f"http://127.0.0.1:{client.server.port}"


async def test_flat_block_ids_option(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(build_engine_app(FakeEngine("old", flat_block_ids=True, block_size=8)))
    desc = (await (await client.post("/v1/completions", json=prefill_body(17))).json())["kv_transfer_params"]
    assert desc["remote_block_ids"] == [0, 1]


async def _two_engines(
    aiohttp_client: ClientFactory, consumer_local_kv: bool = True, **kwargs: Any
) -> tuple[FakeEngine, FakeEngine, TestClient[Any, Any], TestClient[Any, Any]]:
    producer = FakeEngine("p", **kwargs)
    consumer = FakeEngine("d", local_kv=consumer_local_kv)
    pc = await aiohttp_client(build_engine_app(producer))
    dc = await aiohttp_client(build_engine_app(consumer))
    return producer, consumer, pc, dc


@pytest.mark.parametrize("local_kv", [True, False], ids=["in-process", "http-side-channel"])
async def test_decode_reads_and_releases_producer_blocks(
    aiohttp_client: ClientFactory, local_kv: bool
) -> None:
    producer, consumer, pc, dc = await _two_engines(aiohttp_client, consumer_local_kv=local_kv)
    desc = (await (await pc.post("/v1/completions", json=prefill_body(48))).json())["kv_transfer_params"]
    assert producer.stats()["held_blocks"] == 3
    body = {"prompt": words(48), "max_tokens": 2, "stream": True, "kv_transfer_params": desc}
    evs = decoded(await (await dc.post("/v1/completions", json=body)).read())
    assert [e["choices"][0]["text"] for e in evs[:-1]] == [" t0", " t1"] and evs[-1] == "[DONE]"
    assert producer.stats()["held_blocks"] == 0 and producer.stats()["held_requests"] == 0
    assert producer.kv.kv_reads == 1 and consumer.kv_pulls == 1
    assert consumer.get_records()[0]["phase"] == "decode"
    # The same descriptor again: a late read, which vLLM only logs; the decode still succeeds.
    resp = await dc.post("/v1/completions", json={**body, "stream": False})
    assert resp.status == 200
    assert producer.stats()["late_reads"] == 1


async def test_lease_expiry_releases_blocks(
    client: TestClient[Any, Any], aiohttp_client: ClientFactory
) -> None:
    engine = FakeEngine("short", lease_s=0.2)
    c = await aiohttp_client(build_engine_app(engine))
    desc = (await (await c.post("/v1/completions", json=prefill_body(32))).json())["kv_transfer_params"]
    assert engine.stats()["held_blocks"] == 2
    await wait_for(lambda: engine.kv.held_blocks == 0)
    stats = await (await c.get("/fake/stats")).json()
    assert stats["expired_blocks"] == 2 and stats["expired_requests"] == 1 and stats["held_requests"] == 0
    # A decode after expiry: late read, normal output.
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1, "kv_transfer_params": desc}
    )
    assert resp.status == 200 and engine.kv.late_reads == 1


async def test_kv_read_failure(aiohttp_client: ClientFactory) -> None:
    producer, consumer, pc, dc = await _two_engines(aiohttp_client)
    desc = (await (await pc.post("/v1/completions", json=prefill_body(32))).json())["kv_transfer_params"]
    producer.set_faults({"kv_read_fails": True})
    body = {"prompt": "x", "max_tokens": 3, "stream": True, "kv_transfer_params": desc}
    resp = await dc.post("/v1/completions", json=body)
    assert resp.status == 200
    assert decoded(await resp.read()) == [
        {
            "error": {
                "message": "KV transfer failed",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        },
        "[DONE]",
    ]
    resp = await dc.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "kv_transfer_params": desc,
        },
    )
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "KV transfer failed"
    assert consumer.kv_pull_failures == 2 and producer.kv.held_blocks == 2


async def test_kv_read_failure_unreachable_producer(aiohttp_client: ClientFactory) -> None:
    producer, consumer, pc, dc = await _two_engines(aiohttp_client, consumer_local_kv=False)
    desc = (await (await pc.post("/v1/completions", json=prefill_body(32))).json())["kv_transfer_params"]
    await pc.close()  # the producer's port now refuses connections
    resp = await dc.post("/v1/completions", json={"prompt": "x", "stream": True, "kv_transfer_params": desc})
    evs = decoded(await resp.read())
    assert evs[0]["error"]["code"] == 500 and evs[1] == "[DONE]"


# -- faults ------------------------------------------------------------------------------------


def faulty(spec: dict[str, Any], phase: str = "decode", **body: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "fake-model", "prompt": "a b", "max_tokens": 4, "stream": True}
    base.update(body)
    base["narwhal_fake"] = {phase: spec}
    return base


async def test_status_faults(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/completions", json=faulty({"status": 503, "message": "busy"}))
    assert resp.status == 503
    assert await resp.json() == {
        "error": {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}
    }
    resp = await client.post("/v1/completions", json=faulty({"status": 429, "flat_error": True}))
    assert resp.status == 429
    data = await resp.json()
    assert data["object"] == "error" and data["code"] == 429 and data["type"] == "RateLimitError"
    # A prefill fault does not touch a decode, and vice versa.
    resp = await client.post("/v1/completions", json=faulty({"status": 500}, phase="prefill"))
    assert resp.status == 200
    resp = await client.post("/v1/completions", json=prefill_body(narwhal_fake={"prefill": {"status": 500}}))
    assert resp.status == 500


async def test_reset_fault(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    with pytest.raises(aiohttp.ClientError):
        resp = await client.post("/v1/completions", json=faulty({"reset": True}))
        await resp.read()
    assert engine.get_records()[-1]["outcome"] == "reset"
    assert (await client.get("/health")).status == 200


async def test_delay_faults_and_heartbeats(client: TestClient[Any, Any]) -> None:
    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json=faulty({"delay_headers_s": 0.3}))
    assert time.monotonic() - t0 >= 0.3
    await resp.read()

    # Headers arrive at once, then heartbeats (role-only deltas) while the first token waits.
    spec = {"delay_first_token_s": 0.5, "heartbeat_s": 0.1}
    t0 = time.monotonic()
    resp = await client.post(
        "/v1/chat/completions", json=faulty(spec, messages=[{"role": "user", "content": "q"}])
    )
    assert time.monotonic() - t0 < 0.4
    evs = decoded(await resp.read())
    assert time.monotonic() - t0 >= 0.5
    beats = [e for e in evs[1:] if e != "[DONE]" and e["choices"][0]["delta"] == {"role": "assistant"}]
    assert len(beats) >= 2  # 0.5 s of silence at 0.1 s beats: ~4 on an idle machine
    assert [
        e["choices"][0]["delta"]["content"]
        for e in evs
        if e != "[DONE]" and "content" in e["choices"][0]["delta"]
    ] == ["", " t0", " t1", " t2", " t3"]

    # Silence mid-stream with usage-only heartbeats on completions.
    spec = {"silence_after": 2, "silence_s": 0.35, "heartbeat_s": 0.1, "tokens": 3}
    evs = decoded(await (await client.post("/v1/completions", json=faulty(spec))).read())
    kinds = ["hb" if e != "[DONE]" and e["choices"] == [] else "tok" for e in evs[:-1]]
    assert kinds[:2] == ["tok", "tok"] and kinds[-1] == "tok" and kinds.count("hb") >= 1
    assert evs[2]["usage"]["completion_tokens"] == 2
    assert evs[-2]["choices"][0]["finish_reason"] == "stop"  # 3 tokens < max_tokens 4


async def test_token_count_and_rate(client: TestClient[Any, Any]) -> None:
    t0 = time.monotonic()
    evs = decoded(
        await (await client.post("/v1/completions", json=faulty({"tokens": 6, "token_delay_s": 0.05}))).read()
    )
    assert time.monotonic() - t0 >= 0.25
    assert [e["choices"][0]["text"] for e in evs[:-1]] == [f" t{i}" for i in range(6)]
    assert evs[-2]["choices"][0]["finish_reason"] == "length"


async def test_close_after_fault(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    resp = await client.post("/v1/completions", json=faulty({"close_after": 2, "token_delay_s": 0.01}))
    chunks = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for data in resp.content.iter_any():
            chunks += data
    assert b"[DONE]" not in chunks
    assert [e["choices"][0]["text"] for e in decoded(chunks)] == [" t0", " t1"]
    await wait_for(lambda: engine.get_records()[-1]["outcome"] == "closed")
    # Non-streaming: the connection just drops.
    with pytest.raises(aiohttp.ClientError):
        resp = await client.post("/v1/completions", json=faulty({"close_after": 1}, stream=False))
        await resp.read()


async def test_done_before_token_and_empty(client: TestClient[Any, Any]) -> None:
    body = faulty({"done_before_token": True}, messages=[{"role": "user", "content": "q"}])
    evs = decoded(await (await client.post("/v1/chat/completions", json=body)).read())
    assert len(evs) == 2 and evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert evs[1] == "[DONE]"
    evs = decoded(await (await client.post("/v1/completions", json=faulty({"empty": True}))).read())
    assert evs[0]["choices"][0]["text"] == "" and evs[0]["choices"][0]["finish_reason"] == "stop"
    assert evs[1:] == ["[DONE]"]
    data = await (await client.post("/v1/completions", json=faulty({"empty": True}, stream=False))).json()
    assert data["choices"][0]["text"] == "" and data["usage"]["completion_tokens"] == 0


async def test_stream_error_fault(client: TestClient[Any, Any]) -> None:
    spec = {"stream_error": {"code": 503, "message": "overloaded", "after": 2}}
    evs = decoded(await (await client.post("/v1/completions", json=faulty(spec))).read())
    assert [e["choices"][0]["text"] for e in evs[:2]] == [" t0", " t1"]
    assert evs[2] == {
        "error": {"message": "overloaded", "type": "ServiceUnavailableError", "param": None, "code": 503}
    }
    assert evs[3:] == ["[DONE]"]
    spec = {"stream_error": {"code": None, "message": "boom", "flat": True}}
    evs = decoded(await (await client.post("/v1/completions", json=faulty(spec))).read())
    assert evs[0] == {
        "object": "error",
        "message": "boom",
        "type": "InternalServerError",
        "param": None,
        "code": None,
    }
    assert evs[1:] == ["[DONE]"]
    resp = await client.post("/v1/completions", json=faulty({"stream_error": {"code": 502}}, stream=False))
    assert resp.status == 502


@pytest.mark.parametrize(
    ("fault", "check"),
    [
        ("null", lambda d: d is None),
        ("no_engine_id", lambda d: "remote_engine_id" not in d and d["remote_request_id"]),
        ("bad_blocks", lambda d: d["remote_block_ids"] == [["x"]]),
        ("mooncake", lambda d: d["transfer_id"] and d["remote_bootstrap_addr"].startswith("http://")),
        ("lmcache", lambda d: isinstance(d["first_tok"], int)),
        ("bad_port", lambda d: d["remote_port"] == 0),
        ("localhost", lambda d: d["remote_host"] == "localhost"),
    ],
)
async def test_descriptor_faults(
    client: TestClient[Any, Any], engine: FakeEngine, fault: str, check: Callable[[Any], Any]
) -> None:
    data = await (
        await client.post(
            "/v1/completions", json=prefill_body(32, narwhal_fake={"prefill": {"descriptor": fault}})
        )
    ).json()
    assert check(data["kv_transfer_params"])
    # vLLM frees the blocks when it returns no descriptor; a corrupted one pins nothing either
    # (nobody could ever read or free it), so held blocks measure only what a router strands.
    assert engine.kv.held_blocks == (2 if fault == "localhost" else 0)


async def test_descriptor_missing(client: TestClient[Any, Any]) -> None:
    data = await (
        await client.post(
            "/v1/completions", json=prefill_body(32, narwhal_fake={"prefill": {"descriptor": "missing"}})
        )
    ).json()
    assert "kv_transfer_params" not in data


async def test_only_engine_and_engine_wide_merge(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    resp = await client.post("/v1/completions", json=faulty({"status": 500, "only_engine": "other"}))
    assert resp.status == 200
    resp = await client.post("/v1/completions", json=faulty({"status": 500, "only_engine": "e0"}))
    assert resp.status == 500
    # Engine-wide decode faults, overridden field by field by the request.
    engine.set_faults({"decode": {"tokens": 2, "stream_error": {"code": 500, "after": 1}}})
    evs = decoded(await (await client.post("/v1/completions", json={"prompt": "x", "stream": True})).read())
    assert evs[0]["choices"][0]["text"] == " t0" and "error" in evs[1]
    evs = decoded(await (await client.post("/v1/completions", json=faulty({"stream_error": None}))).read())
    assert [e["choices"][0]["text"] for e in evs[:-1]] == [" t0", " t1"]
    # Prefill requests are untouched by decode faults.
    assert (await client.post("/v1/completions", json=prefill_body())).status == 200


# -- stats, records, aborts --------------------------------------------------------------------


async def test_stats_and_records(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    headers = {
        "X-Request-Id": "rid-1",
        "Authorization": "Bearer k",
        "traceparent": "00-abc-def-01",
        "X-Other": "no",
    }
    await (await client.post("/v1/completions", json=prefill_body(), headers=headers)).read()
    await (await client.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 2})).read()
    # A same-engine warm-up prefill: no kv_transfer_params, max_tokens 1, ignore_eos.
    await (
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "ignore_eos": True})
    ).read()
    stats = engine.stats()
    assert stats["requests"] == {"prefill": 2, "decode": 1, "total": 3}
    assert stats["completed_streams"] == 1 and stats["active_streams"] == 0 and stats["aborted_streams"] == 0
    rec = engine.get_records()[0]
    assert rec["phase"] == "prefill" and rec["path"] == "/v1/completions" and rec["outcome"] == "completed"
    assert rec["headers"] == {
        "x-request-id": "rid-1",
        "authorization": "Bearer k",
        "traceparent": "00-abc-def-01",
        "content-type": "application/json",
    }
    assert rec["body"]["kv_transfer_params"] == PREFILL_KV and isinstance(rec["t"], float)
    assert len(engine.get_records('"stream":true')) == 1
    engine.clear_records()
    assert engine.get_records() == []


def test_records_past_the_bound_are_dropped_and_counted() -> None:
    engine = FakeEngine("bounded", records_max=2)
    for i in range(3):
        engine.record("prefill", "/v1/completions", {"x-request-id": f"r{i}"}, {})
    assert [r["headers"]["x-request-id"] for r in engine.get_records()] == ["r1", "r2"]
    assert engine.stats()["records_dropped"] == 1


async def test_aborted_stream_when_client_disconnects(
    client: TestClient[Any, Any], engine: FakeEngine
) -> None:
    resp = await client.post("/v1/completions", json=faulty({"tokens": 200, "token_delay_s": 0.02}))
    await resp.content.readuntil(b"\n\n")
    assert engine.stats()["active_streams"] == 1
    resp.close()
    await wait_for(lambda: engine.aborted_streams == 1)
    assert engine.stats()["active_streams"] == 0 and engine.completed_streams == 0
    assert engine.get_records()[-1]["outcome"] == "aborted"


async def test_abort_before_pull_releases_producer(aiohttp_client: ClientFactory) -> None:
    producer, consumer, pc, dc = await _two_engines(aiohttp_client)
    desc = (await (await pc.post("/v1/completions", json=prefill_body(32))).json())["kv_transfer_params"]
    body = faulty({"delay_headers_s": 5}, kv_transfer_params=desc)
    with pytest.raises(asyncio.TimeoutError):
        await dc.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2))
    await wait_for(lambda: producer.kv.held_blocks == 0)
    assert consumer.aborted_streams == 1 and producer.kv.kv_reads == 1


@pytest.mark.parametrize(
    "spec",
    [{}, {"token_delay_s": 0.01, "silence_after": 2, "silence_s": 0.25, "heartbeat_s": 0.1}],
    ids=["no-delay", "delays"],
)
async def test_coalesced_stream_is_identical(aiohttp_client: ClientFactory, spec: dict[str, Any]) -> None:
    c = await aiohttp_client(build_engine_app(FakeEngine("c", coalesce=True)))
    body = faulty(spec, max_tokens=5, stream_options={"include_usage": True})
    evs = decoded(await (await c.post("/v1/completions", json=body)).read())
    texts = [e["choices"][0]["text"] for e in evs[:-1] if e["choices"]]
    assert texts == [f" t{i}" for i in range(5)] and evs[-1] == "[DONE]"
    assert evs[-2]["usage"]["completion_tokens"] == 5
    beats = [e for e in evs[:-2] if not e["choices"]]
    assert (len(beats) >= 1) if spec else not beats


# -- fleet and control server ------------------------------------------------------------------


async def test_fleet_control_routes_in_process() -> None:
    fleet = Fleet(["a", "b"], lease_s=30)
    ready = await fleet.start()
    try:
        async with aiohttp.ClientSession() as s:
            ctl = ready["control"]
            put = await s.put(
                f"{ctl}/engines/a/faults", json={"decode": {"status": 429}, "kv_read_fails": True}
            )
            assert (await put.json())["faults"]["decode"] == {"status": 429}
            assert (await s.put(f"{ctl}/engines/a/faults", json={"bogus": 1})).status == 400
            assert (await s.get(f"{ctl}/engines/zzz/stats")).status == 404
            resp = await s.post(f"{ready['engines']['a']}/v1/completions", json={"prompt": "x"})
            assert resp.status == 429
            reqs = await (
                await s.get(f"{ctl}/engines/a/requests", params={"contains": '"prompt":"x"'})
            ).json()
            assert reqs["count"] == 1 and reqs["requests"][0]["status"] == 429
            assert (await (await s.delete(f"{ctl}/engines/a/faults")).json())["faults"] == {}
            # Crossed handoff a -> b through the control-visible stats.
            pre = await (
                await s.post(f"{ready['engines']['a']}/v1/completions", json=prefill_body(32))
            ).json()
            everything = await (await s.get(f"{ctl}/engines")).json()
            assert everything["a"]["held_blocks"] == 2 and set(everything) == {"a", "b"}
            body = {"prompt": "x", "max_tokens": 1, "kv_transfer_params": pre["kv_transfer_params"]}
            assert (await s.post(f"{ready['engines']['b']}/v1/completions", json=body)).status == 200
            assert (await (await s.get(f"{ctl}/engines/a/stats")).json())["held_blocks"] == 0
            # The real AppRunner cancels the handler of a stream whose client went away.
            stream = await s.post(
                f"{ready['engines']['b']}/v1/completions", json=faulty({"tokens": 100, "token_delay_s": 0.05})
            )
            await stream.content.readuntil(b"\n\n")
            stream.close()
            await wait_for(lambda: fleet.engines["b"].aborted_streams == 1)
            # Stop aborts an open stream and refuses new connections; start listens again.
            stream = await s.post(
                f"{ready['engines']['b']}/v1/completions", json=faulty({"tokens": 100, "token_delay_s": 0.05})
            )
            await stream.content.readuntil(b"\n\n")
            stopped = await (await s.post(f"{ctl}/engines/b/stop")).json()
            assert stopped["serving"] is False
            with pytest.raises(aiohttp.ClientPayloadError):
                await stream.read()
            with pytest.raises(aiohttp.ClientConnectorError):
                await s.get(f"{ready['engines']['b']}/health")
            started = await (await s.post(f"{ctl}/engines/b/start")).json()
            assert started == {"name": "b", "serving": True, "url": ready["engines"]["b"]}
            assert (await s.get(f"{ready['engines']['b']}/health")).status == 200
            # A stopped producer cannot serve reads, even through the in-process registry.
            pre = await (
                await s.post(f"{ready['engines']['b']}/v1/completions", json=prefill_body(32))
            ).json()
            await s.post(f"{ctl}/engines/b/stop")
            body = {"prompt": "x", "stream": True, "kv_transfer_params": pre["kv_transfer_params"]}
            evs = decoded(await (await s.post(f"{ready['engines']['a']}/v1/completions", json=body)).read())
            assert evs[0]["error"]["message"] == "KV transfer failed" and evs[1:] == ["[DONE]"]
            await s.post(f"{ctl}/engines/b/start")
            assert (await (await s.post(f"{ctl}/reset")).json()) == {"reset": ["a", "b"]}
            assert (await (await s.delete(f"{ctl}/engines/b/requests")).json())["cleared"] == 0
    finally:
        await fleet.close()


def _http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None


def test_fleet_process_cli(tmp_path: Path) -> None:
    ready_file = tmp_path / "ready.json"
    code = "from narwhal.fake_engine import main; raise SystemExit(main(sys.argv[1:]))"
    argv = ["--engine", "p0", "--engine", "d0", "--lease-s", "5", "--ready-file", str(ready_file)]
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; {code}", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        readable, _, _ = select.select([proc.stdout], [], [], 15)
        assert readable, "no ready line"
        ready = json.loads(proc.stdout.readline())
        assert set(ready) == {"control", "engines"} and set(ready["engines"]) == {"p0", "d0"}
        assert json.loads(ready_file.read_text()) == ready
        ctl, p0 = ready["control"], ready["engines"]["p0"]
        status, data = _http("POST", f"{p0}/v1/completions", prefill_body(32))
        assert status == 200 and data["kv_transfer_params"]["remote_port"] == int(p0.rsplit(":", 1)[1])
        assert _http("GET", f"{ctl}/engines/p0/stats")[1]["held_blocks"] == 2
        assert _http("POST", f"{ctl}/engines/p0/stop")[1]["serving"] is False
        with pytest.raises(urllib.error.URLError) as info:
            _http("GET", f"{p0}/health")
        assert isinstance(info.value.reason, ConnectionRefusedError)
        assert _http("POST", f"{ctl}/engines/p0/start")[1]["serving"] is True
        assert _http("GET", f"{p0}/health")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        stderr = proc.stderr.read().decode()
        assert "Traceback" not in stderr, stderr
        assert proc.stdout.read() == b""  # exactly one line on stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
async def test_the_engine_listens_with_uvicorns_backlog() -> None:
    # vLLM listens through uvicorn (backlog 2048); with aiohttp's 128 a thousand streams
    # connecting at once were reset by the fake, as no real engine would reset them.
    engine = FakeEngine("e0")
    await engine.start()
    try:
        out = subprocess.run(["ss", "-ltnH", f"sport = :{engine.port}"], capture_output=True, text=True, check=True)
        send_q = [int(line.split()[2]) for line in out.stdout.splitlines() if line.strip()]
        with open("/proc/sys/net/core/somaxconn") as f:  # the kernel caps any backlog at this
            cap = int(f.read())
        assert send_q == [min(2048, cap)]
    finally:
        await engine.close()
