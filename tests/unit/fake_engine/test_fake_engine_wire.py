"""The fake vLLM engine's wire format and its imitation of the KV handoff (vLLM's sources)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, build_engine_app
from tests.unit.fake_engine.fe_support import (
    ClientFactory,
    decoded,
    prefill_body,
    two_engines,
    wait_for,
    words,
)
from tests.wire import PREFILL_KV

# -- wire format -------------------------------------------------------------------------------


# The exact token frames of each release, read from its serving code: 0.11 dumps completions
# chunks whole (``exclude_unset=False``), 0.33 only what it set, which adds ``weight_versions`` to
# the last choice and ``kv_transfer_params`` to every chunk. {h} is the chunk's id/created/model.
COMPLETION_FRAMES = {
    "0.11.0": (b'{h,"choices":[{"index":0,"text":" t1","logprobs":null,"finish_reason":null,"stop_reason":null,'
               b'"prompt_token_ids":null,"token_ids":null}],"usage":null}'),
    "0.33.0": (b'{h,"choices":[{"index":0,"text":" t1","logprobs":null,"finish_reason":null,"stop_reason":null,'
               b'"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}'),
}
CHAT_ROLE_TAILS = {"0.11.0": b',"prompt_token_ids":null}', "0.33.0": b',"prompt_token_ids":null,"prompt_text":null}'}
CHAT_LAST_CHOICES = {
    "0.11.0": {"stop_reason": None, "token_ids": None},
    "0.33.0": {"stop_reason": None, "token_ids": None, "weight_versions": None},
}


def _head(frame: dict[str, Any]) -> bytes:
    return (b'{"id":"' + frame["id"].encode() + b'","object":"' + frame["object"].encode() + b'","created":'
            + str(frame["created"]).encode() + b',"model":"fake-model"')


async def _stream(aiohttp_client: ClientFactory, version: str, path: str, body: dict[str, Any]) -> bytes:
    client = await aiohttp_client(build_engine_app(FakeEngine("e-" + version, version=version)))
    resp = await client.post(path, json={"model": "fake-model", "stream": True, **body})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    return await resp.read()


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
async def test_completions_stream_wire_format(aiohttp_client: ClientFactory, version: str) -> None:
    body = {"prompt": "a b c", "max_tokens": 3, "stream_options": {"include_usage": True}}
    raw = await _stream(aiohttp_client, version, "/v1/completions", body)
    evs = decoded(raw)
    assert evs[-1] == "[DONE]"
    tokens = evs[:3]
    first = tokens[0]
    assert first["id"].startswith("cmpl-") and first["object"] == "text_completion"
    assert isinstance(first["created"], int) and first["model"] == "fake-model"
    assert [t["choices"][0]["text"] for t in tokens] == [" t0", " t1", " t2"]
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, "length"]
    assert evs[3]["choices"] == [] and evs[3]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert len(evs) == 5
    # Exact bytes of a token frame: what routers relay without re-encoding.
    assert raw.split(b"\n\n")[1] == b"data: " + COMPLETION_FRAMES[version].replace(b"{h", _head(first))


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
async def test_chat_stream_wire_format(aiohttp_client: ClientFactory, version: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_completion_tokens": 2}
    raw = await _stream(aiohttp_client, version, "/v1/chat/completions", body)
    evs = decoded(raw)
    assert evs[0]["object"] == "chat.completion.chunk" and evs[0]["id"].startswith("chatcmpl-")
    role = b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
    assert raw.split(b"\n\n")[0] == b"data: " + _head(evs[0]) + b"," + role + CHAT_ROLE_TAILS[version]
    assert evs[1]["choices"] == [
        {"index": 0, "delta": {"content": " t0"}, "logprobs": None, "finish_reason": None, "token_ids": None}]
    assert evs[2]["choices"] == [{"index": 0, "delta": {"content": " t1"}, "logprobs": None,
                                  "finish_reason": "length", **CHAT_LAST_CHOICES[version]}]
    current = version == "0.33.0"
    assert all(("kv_transfer_params" in e) is current for e in evs[1:3])
    assert all(e.get("kv_transfer_params") is None for e in evs[1:3])
    assert evs[3:] == ["[DONE]"]


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(
    aiohttp_client: ClientFactory, version: str, path: str
) -> None:
    """``stream_options.continuous_usage_stats`` (with ``include_usage``; guidellm always asks,
    aiperf with ``--per-chunk-usage``): every chunk carries the usage so far, as each release
    dumps it, and the usage-only chunk still ends the stream."""
    chat = path.endswith("chat/completions")
    prompt = {"messages": [{"role": "user", "content": "a b c"}]} if chat else {"prompt": "a b c"}
    options = {"include_usage": True, "continuous_usage_stats": True}
    evs = decoded(await _stream(aiohttp_client, version, path, {**prompt, "max_tokens": 3, "stream_options": options}))
    assert evs[-1] == "[DONE]"
    chunks = [e for e in evs[:-2] if e["choices"]]
    p = evs[-2]["usage"]["prompt_tokens"]
    done = [0, 1, 2, 3] if chat else [1, 2, 3]  # chat's role chunk first, with 0 completion tokens
    extra: dict[str, Any] = {}
    if chat and version == "0.33.0":
        extra = {"completion_tokens_details": None}
    elif not chat and version == "0.11.0":
        extra = {"prompt_tokens_details": None}
    assert [c["usage"] for c in chunks] == [
        {"prompt_tokens": p, "total_tokens": p + k, "completion_tokens": k, **extra} for k in done]
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 3
    # Without continuous_usage_stats (or without include_usage) no content chunk has a usage object.
    plain = decoded(await _stream(aiohttp_client, version, path, {**prompt, "max_tokens": 3, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}}))
    assert all(not e.get("usage") for e in plain[:-1])


async def test_a_continuations_running_usage_counts_from_its_own_start(aiohttp_client: ClientFactory) -> None:
    """A continuation (the prompt ends with the output so far, `` t0 t1``) generates `` t2`` …;
    vLLM counts its usage from the request's first token: 1, 2, 3, not the whole output's 3, 4, 5."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    evs = decoded(await _stream(aiohttp_client, "0.33.0", "/v1/completions",
                                {"prompt": "a b c t0 t1", "max_tokens": 3, "stream_options": options}))
    chunks = [e for e in evs[:-2] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " t2 t3 t4"
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert evs[-2]["usage"]["completion_tokens"] == 3


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
    # vLLM's model validator (seen on a real 0.32 engine): truthy options without a stream.
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}})
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        "type": "BadRequestError", "param": "stream_options", "code": 400}
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream_options": {}})
    assert resp.status == 200  # an empty object is falsy there: accepted
    # FastAPI's request validation: "Bad Request", the field as body.<name>.
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": "two"})
    err = (await resp.json())["error"]
    assert (resp.status, err["type"], err["param"]) == (400, "Bad Request", "body.max_tokens")
    assert err["message"].startswith("1 validation error:\n  {'type': 'int_type', 'loc': 'body.max_tokens'")
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": "2"})
    assert resp.status == 200  # pydantic's lax mode: a numeric string is the number
    resp = await client.post(
        "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert sum(r["outcome"] != "error" for r in engine.get_records()) == 2  # empty options, "2"


async def test_operational_routes(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    resp = await client.get("/health")
    assert resp.status == 200 and await resp.read() == b""
    assert await (await client.get("/version")).json() == {"version": "0.33.0"}
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    entry = models["data"][0]
    assert entry["id"] == entry["root"] == "fake-model" and entry["owned_by"] == "vllm"
    assert entry["parent"] is None and entry["max_model_len"] == 8192
    assert [p["object"] for p in entry["permission"]] == ["model_permission"]  # as a real engine lists it
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
        "remote_block_ids": [[0, 1, 2]],  # cdiv(40, 16): the partial last block is sent too
        "remote_engine_id": engine.engine_id,
        "remote_request_id": "cmpl-r1-0",
        "remote_host": "127.0.0.1",
        "remote_port": client.server.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": None,
        "remote_registration_generation": 1,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    }
    # A prompt shorter than a block: one block; a reused request id stays unique.
    resp = await client.post("/v1/completions", json=prefill_body(5), headers={"X-Request-Id": "r1"})
    desc2 = (await resp.json())["kv_transfer_params"]
    assert desc2["remote_block_ids"] == [[3]] and desc2["remote_request_id"] != "cmpl-r1-0"
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": words(33)}],
            "max_tokens": 1,
            "kv_transfer_params": dict(PREFILL_KV),
        },
    )
    assert (await resp.json())["kv_transfer_params"]["remote_block_ids"] == [[4, 5, 6]]
    stats = await (await client.get("/fake/stats")).json()
    assert stats["held_blocks"] == 7 and stats["held_requests"] == 3
    assert stats["requests"] == {"prefill": 3, "decode": 0, "total": 3}
    assert stats["engine_id"] == engine.engine_id and stats["name"] == "e0"
    assert stats["url"] == f"http://127.0.0.1:{client.server.port}"


async def test_flat_block_ids_option(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(build_engine_app(FakeEngine("old", flat_block_ids=True, block_size=8)))
    desc = (await (await client.post("/v1/completions", json=prefill_body(17))).json())["kv_transfer_params"]
    assert desc["remote_block_ids"] == [0, 1, 2]


@pytest.mark.parametrize("local_kv", [True, False], ids=["in-process", "http-side-channel"])
async def test_decode_reads_and_releases_producer_blocks(
    aiohttp_client: ClientFactory, local_kv: bool
) -> None:
    producer, consumer, pc, dc = await two_engines(aiohttp_client, consumer_local_kv=local_kv)
    desc = (await (await pc.post("/v1/completions", json=prefill_body(48))).json())["kv_transfer_params"]
    assert producer.stats()["held_blocks"] == 3  # 48 tokens, blocks of 16
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
    producer, consumer, pc, dc = await two_engines(aiohttp_client)
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
    producer, consumer, pc, dc = await two_engines(aiohttp_client, consumer_local_kv=False)
    desc = (await (await pc.post("/v1/completions", json=prefill_body(32))).json())["kv_transfer_params"]
    await pc.close()  # the producer's port now refuses connections
    resp = await dc.post("/v1/completions", json={"prompt": "x", "stream": True, "kv_transfer_params": desc})
    evs = decoded(await resp.read())
    assert evs[0]["error"]["code"] == 500 and evs[1] == "[DONE]"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 70}),
    ("/v1/responses", {"input": "a b", "max_output_tokens": 70}),
    ("/v1/completions", {"prompt": "a b", "max_tokens": 70}),
])
async def test_every_endpoint_refuses_max_tokens_beyond_the_context(
    aiohttp_client: ClientFactory, path: str, body: dict[str, Any]
) -> None:
    """0.33 (and a real 0.32 engine) refuses only ``max_tokens > max_model_len``, with its own
    message, inside the handler; a smaller one is clamped to what the context has left."""
    engine = FakeEngine("ctx", max_model_len=64, enable_scale_out=True)
    client = await aiohttp_client(build_engine_app(engine))
    resp = await client.post(path, json={"model": "fake-model", **body})
    assert resp.status == 400
    assert "max_tokens=70 cannot be greater than max_model_len=64. Please request fewer output tokens." \
        in await resp.text()
    body = {k: (63 if k in ("max_tokens", "max_output_tokens") else v) for k, v in body.items()}
    resp = await client.post(path, json={"model": "fake-model", **body})
    assert resp.status == 200  # 2 prompt tokens + 63 > 64: clamped, not refused


async def test_generate_never_refuses_on_length(aiohttp_client: ClientFactory) -> None:
    engine = FakeEngine("ctx", max_model_len=64, enable_scale_out=True)
    client = await aiohttp_client(build_engine_app(engine))
    body = {"model": "fake-model", "token_ids": [1, 2], "sampling_params": {"max_tokens": 70}}
    assert (await client.post("/inference/v1/generate", json=body)).status == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_0_11_refuses_a_prompt_and_max_tokens_beyond_the_context(
    aiohttp_client: ClientFactory, path: str
) -> None:
    engine = FakeEngine("ctx", max_model_len=64, version="0.11.0")
    client = await aiohttp_client(build_engine_app(engine))
    body: dict[str, Any] = {"model": "fake-model", "max_tokens": 63}
    body.update({"prompt": "a b"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a b"}]})
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert "is too large: 63. This model's maximum context length is 64 tokens" in await resp.text()


async def test_a_0_21_engine_sends_nine_keys_and_serves_generate_with_no_flag(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(build_engine_app(FakeEngine("v21", version="0.21.0")))
    desc = (await (await client.post("/v1/completions", json=prefill_body(20))).json())["kv_transfer_params"]
    assert list(desc) == ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                          "remote_request_id", "remote_host", "remote_port", "tp_size", "remote_num_tokens"]
    body = {"model": "fake-model", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    assert (await client.post("/inference/v1/generate", json=body)).status == 200


@pytest.mark.parametrize(("version", "handed"), [("0.33.0", True), ("0.32.0", False)])
async def test_a_streamed_prefill_carries_its_handoff_on_the_last_chunk_from_0_33(
    aiohttp_client: ClientFactory, version: str, handed: bool
) -> None:
    engine = FakeEngine("sp", version=version)
    client = await aiohttp_client(build_engine_app(engine))
    body = {**prefill_body(40), "stream": True, "max_tokens": 2}
    raw = await (await client.post("/v1/completions", json=body)).read()
    chunks = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    if handed:  # 0.33: the descriptor rides on the chunk with the finish_reason, null before it
        assert all(c["kv_transfer_params"] is None for c in chunks[:-1])
        assert last["kv_transfer_params"]["remote_block_ids"] == [[0, 1, 2]]
        assert engine.stats()["held_blocks"] == 3
    else:  # a real 0.32 engine: no descriptor in a stream, the blocks pinned all the same
        assert all("kv_transfer_params" not in c for c in chunks)
        assert engine.stats()["held_blocks"] == 3
