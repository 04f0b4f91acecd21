"""The fake's prefix cache as vLLM's block pool (docs/behaviour.md "Fake engines", "Placement"): a block a running
request uses is
never evicted, free blocks go least recently freed first (a request's tail before its prefix),
a shared prefix counts once; ``vllm:cache_config_info``; each endpoint's cached tokens in its own
usage field; a prefill cost per engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, Fleet, build_engine_app
from narwhal.fake_engine.fleet import _models, _parser
from narwhal.fake_engine.prefix import PrefixCache, prompt_text, text_tokens
from narwhal.fake_engine.state import EngineModel

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]
BLOCK_CHARS = 64
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}


def text_of(blocks: int, tag: str = "a") -> str:
    return "".join(f"{tag}{i:03d}".ljust(BLOCK_CHARS, ".") for i in range(blocks))


def run(cache: PrefixCache, text: str) -> int:
    """One request through the pool: take its blocks, look up, compute, give them back."""
    hashes = cache.block_hashes(text)
    cache.acquire(hashes)
    hit = cache.lookup(hashes, text_tokens(text) + 1)
    cache.insert(hashes)
    cache.release(hashes)
    return hit


def cached(cache: PrefixCache, text: str) -> int:
    return cache.lookup(cache.block_hashes(text), text_tokens(text) + 1)


def test_free_blocks_are_evicted_least_recently_freed_first() -> None:
    cache = PrefixCache(capacity=4)
    a, b, c = text_of(2, "a"), text_of(2, "b"), text_of(2, "c")
    run(cache, a)
    run(cache, b)
    assert run(cache, a) == 32  # a hit: a is the most recently freed now
    run(cache, c)  # c's two blocks take the queue's head: b's
    assert len(cache) == 4
    assert (cached(cache, a), cached(cache, b), cached(cache, c)) == (32, 0, 32)


def test_a_block_in_use_is_never_evicted() -> None:
    cache = PrefixCache(capacity=4)
    a = cache.block_hashes(text_of(4, "a"))
    cache.acquire(a)
    cache.insert(a)  # a long prefill still running: its 4 blocks fill the pool
    for tag in "bcd":
        run(cache, text_of(4, tag))  # each computes, then its blocks are the first to go
    assert cached(cache, text_of(4, "a")) == 64
    cache.release(a)
    run(cache, text_of(2, "e"))  # now a is free: its tail goes first, its prefix stays
    assert cached(cache, text_of(4, "a")) == 32 and len(cache) == 4


def test_blocks_without_a_hash_take_room_from_the_cache() -> None:
    cache = PrefixCache(capacity=4)
    run(cache, text_of(3))
    cache.trim(others=2)  # running prompts' tails: 2 blocks in use without a hash
    assert len(cache) == 2 and cached(cache, text_of(3)) == 32


def test_prompt_text_of_every_endpoint() -> None:
    messages = {"system": "be brief", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(messages, chat=False, kind="messages") == "system\nbe brief\nuser\nhi\n"
    assert prompt_text({"instructions": "sys ", "input": "question"}, chat=False, kind="responses") == "sys question"
    items = {"input": [{"role": "user", "content": "q"}]}
    assert prompt_text(items, chat=False, kind="responses") == "user\nq\n"
    assert prompt_text({"token_ids": [1, 22]}, chat=False, kind="generate") == "1 22"


# -- through the engine -------------------------------------------------------------------------


def cached_engine(**model: Any) -> FakeEngine:
    return FakeEngine("e0", load_model=EngineModel(prefix_cache=True, **model), enable_scale_out=True)


async def test_a_running_prefix_survives_a_flood_of_others(aiohttp_client: ClientFactory) -> None:
    engine = cached_engine(kv_blocks=12)
    client = await aiohttp_client(build_engine_app(engine))
    slow = {"decode": {"token_delay_s": 0.05}}
    held = await client.post(
        "/v1/completions", json={"prompt": text_of(4), "stream": True, "max_tokens": 200, "narwhal_fake": slow}
    )
    await held.content.readuntil(b"\n\n")  # running: its 4 blocks are in use
    for tag in "bcdefg":
        assert (await client.post("/v1/completions", json={"prompt": text_of(4, tag), "max_tokens": 1})).status == 200
    again = await (await client.post("/v1/completions", json={"prompt": text_of(4) + "more", "max_tokens": 1})).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    held.close()


async def test_cache_config_info_carries_vllms_labels(aiohttp_client: ClientFactory) -> None:
    engine = cached_engine(kv_blocks=640)
    client = await aiohttp_client(build_engine_app(engine))
    text = await (await client.get("/metrics")).text()
    assert "# TYPE vllm:cache_config_info gauge" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert line.endswith("} 1.0")
    for label in ('block_size="16"', 'num_gpu_blocks="640"', 'enable_prefix_caching="True"', 'engine="0"',
                  'cache_dtype="auto"', 'gpu_memory_utilization="0.92"', 'num_gpu_blocks_override="None"',
                  'kv_cache_size_tokens="10240"', 'hash_block_size="None"'):
        assert label in line
    # 0.33's order (vllm/config/cache.py): block_size first, engine last, the new labels between
    names = [part.split("=")[0] for part in line[line.index("{") + 1 : line.index("}")].split(",")]
    assert names[0] == "block_size" and names[-1] == "engine"
    assert names.index("num_gpu_blocks") < names.index("kv_cache_size_tokens") < names.index("hash_block_size")
    engine.set_load_model(EngineModel(prefix_cache=False, kv_blocks=100))
    line = next(ln for ln in (await (await client.get("/metrics")).text()).splitlines()
                if ln.startswith("vllm:cache_config_info{"))
    assert 'num_gpu_blocks="100"' in line and 'enable_prefix_caching="False"' in line


async def test_responses_report_cached_tokens_in_input_tokens_details(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(build_engine_app(cached_engine()))
    body = {"model": "fake-model", "input": text_of(4), "max_output_tokens": 1, "kv_transfer_params": PREFILL_KV}
    first = await (await client.post("/v1/responses", json=body)).json()
    assert first["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    second = await (await client.post("/v1/responses", json={**body, "input": text_of(4) + "next"})).json()
    assert second["usage"]["input_tokens"] == text_tokens(text_of(4) + "next")
    assert second["usage"]["input_tokens_details"] == {"cached_tokens": 64}


async def test_messages_report_cached_tokens_as_cache_reads(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(build_engine_app(cached_engine()))
    system = text_of(4)
    body = {"model": "fake-model", "max_tokens": 1, "system": system, "messages": [{"role": "user", "content": "q1"}],
            "kv_transfer_params": PREFILL_KV}
    first = await (await client.post("/v1/messages", json=body)).json()
    tokens = text_tokens(prompt_text(body, chat=False, kind="messages"))
    assert first["usage"] == {"input_tokens": tokens, "output_tokens": 1}
    second = await (await client.post("/v1/messages", json=body)).json()
    assert second["usage"] == {"input_tokens": tokens - 64, "output_tokens": 1, "cache_read_input_tokens": 64}


async def test_generate_reports_usage_as_vllm_0_33(aiohttp_client: ClientFactory) -> None:
    # scale_out/token_in_token_out/serving.py: the answer's usage; the cached part only with
    # --enable-prompt-tokens-details, which the fake's generate does not imitate.
    engine = cached_engine()
    client = await aiohttp_client(build_engine_app(engine))
    body = {"model": "fake-model", "token_ids": list(range(100, 200)), "sampling_params": {"max_tokens": 1}}
    for _ in range(2):
        answer = await (await client.post("/inference/v1/generate", json=body)).json()
        assert answer["usage"] == {"prompt_tokens": 100, "total_tokens": 101, "completion_tokens": 1}
    assert engine.prefix_hits > 0  # cached all the same
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    raw = await (await client.post("/inference/v1/generate", json=stream)).read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and b'"choices":[]' in events[-2]
    assert b'"usage":{"prompt_tokens":100,"total_tokens":101,"completion_tokens":1}' in events[-2]


def test_prefill_cost_per_engine_from_the_command_line() -> None:
    args = _parser().parse_args(["--prefill-us-per-token", "20", "--prefill-us-per-token", "p1=40"])
    models = _models(args, ["p0", "p1"])
    assert not isinstance(models, str)
    base, own = models
    assert base.prefill_s_per_token == pytest.approx(20e-6)
    assert list(own) == ["p1"] and own["p1"].prefill_s_per_token == pytest.approx(40e-6)
    bad = _parser().parse_args(["--prefill-us-per-token", "p9=40"])
    assert _models(bad, ["p0"]) == "--prefill-us-per-token p9=40: no engine named 'p9'"
    assert _models(_parser().parse_args(["--prefill-us-per-token", "p0=x"]), ["p0"]) == (
        "--prefill-us-per-token p0=x: not a number of microseconds"
    )


def test_engines_of_one_fleet_have_their_own_prefill_cost() -> None:
    fleet = Fleet(["p0", "p1"], load_model=EngineModel(prefill_s_per_token=1e-5),
                  models={"p1": EngineModel(prefill_s_per_token=2e-5)})
    assert fleet.engines["p0"].load_model.prefill_s_per_token == 1e-5
    assert fleet.engines["p1"].load_model.prefill_s_per_token == 2e-5
