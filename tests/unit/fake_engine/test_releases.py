"""The fake imitates each vLLM release (docs/decisions.md "vLLM releases", ``narwhal.fake_engine.release``): 0.33 by
default,
0.11 with ``--vllm-version 0.11.0``. Each expectation is the release's own shape
(vLLM's NixlConnector, `nixl_connector.py`, in each release), never what the router accepts."""

from __future__ import annotations

import asyncio
from typing import Any

from narwhal.fake_engine import FakeEngine, build_engine_app
from tests.unit.fake_engine.fe_support import ClientFactory, prefill_body

KEYS_011 = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_host",
            "remote_port", "tp_size"}
KEYS_033 = KEYS_011 | {"remote_request_id", "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time",
                       "remote_registration_generation", "transfer_mode", "remote_prefill_cached_tokens"}


async def _prefill(client: Any, rid: str) -> dict[str, Any]:
    answer = await (await client.post("/v1/completions", json=prefill_body(40), headers={"X-Request-Id": rid})).json()
    desc: dict[str, Any] = answer["kv_transfer_params"]
    return desc


async def test_a_011_engine_sends_seven_keys_and_flat_block_ids(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(build_engine_app(FakeEngine("old", version="0.11.0", block_size=8)))
    desc = await _prefill(client, "r1")
    assert set(desc) == KEYS_011
    assert desc["remote_block_ids"] == list(range(len(desc["remote_block_ids"]))) and desc["remote_block_ids"]
    assert await (await client.get("/version")).json() == {"version": "0.11.0"}
    line = next(ln for ln in (await (await client.get("/metrics")).text()).splitlines()
                if ln.startswith("vllm:cache_config_info{"))
    assert "kv_cache_size_tokens" not in line and "hash_block_size" not in line
    assert (await client.post("/inference/v1/generate", json={"token_ids": [1], "sampling_params": {}})).status != 403


async def test_a_033_engine_sends_every_key_nested_and_gates_generate(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(build_engine_app(FakeEngine("new", block_size=8)))
    desc = await _prefill(client, "r2")
    assert set(desc) == KEYS_033
    assert isinstance(desc["remote_block_ids"], list) and isinstance(desc["remote_block_ids"][0], list)
    assert desc["transfer_mode"] == "pull" and desc["remote_prefill_cached_tokens"] == 0
    resp = await client.post("/inference/v1/generate", json={"token_ids": [1], "sampling_params": {"max_tokens": 1}})
    body = await resp.json()
    assert resp.status == 403 and body["error"]["type"] == "PermissionDeniedError"
    assert "--enable-scale-out" in body["error"]["message"]


async def _refused_decode(aiohttp_client: ClientFactory, version: str) -> int:
    """Held blocks on the producer after a consumer of the same release refuses the decode (400)."""
    producer = FakeEngine(f"p-{version}", version=version, block_size=8)
    consumer = FakeEngine(f"d-{version}", version=version, block_size=8)
    p_client = await aiohttp_client(build_engine_app(producer))
    d_client = await aiohttp_client(build_engine_app(consumer))
    desc = await _prefill(p_client, "r3")
    assert producer.stats()["held_requests"] == 1
    decode = {"model": "fake-model", "prompt": "x", "max_tokens": -1, "kv_transfer_params": desc}
    resp = await d_client.post("/v1/completions", json=decode, headers={"X-Request-Id": "r3"})
    assert resp.status == 400
    for _ in range(50):  # the cleanup is a task of the consumer's
        if producer.stats()["held_requests"] == 0:
            break
        await asyncio.sleep(0.01)
    held: int = producer.stats()["held_requests"]
    return held


async def test_a_refused_decode_frees_the_producer_on_033_and_not_on_011(aiohttp_client: ClientFactory) -> None:
    assert await _refused_decode(aiohttp_client, "0.33.0") == 0
    assert await _refused_decode(aiohttp_client, "0.11.0") == 1


async def test_a_decode_across_versions_fails_and_is_counted_incompatible(aiohttp_client: ClientFactory) -> None:
    producer = FakeEngine("p-old", version="0.32.0", block_size=8)
    consumer = FakeEngine("d-new", block_size=8)
    p_client = await aiohttp_client(build_engine_app(producer))
    d_client = await aiohttp_client(build_engine_app(consumer))
    desc = await _prefill(p_client, "r4")
    decode = {"model": "fake-model", "prompt": "x", "max_tokens": 2, "kv_transfer_params": desc}
    resp = await d_client.post("/v1/completions", json=decode, headers={"X-Request-Id": "r4"})
    assert resp.status == 500
    assert consumer.stats()["incompatible_decodes"] == 1 and consumer.stats()["kv_pull_failures"] == 1
