"""The fake engine's injected faults: statuses, resets, delays, in-stream errors, descriptor faults."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine
from tests.unit.fake_engine.fe_support import decoded, faulty, prefill_body, wait_for

# -- faults ------------------------------------------------------------------------------------


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
