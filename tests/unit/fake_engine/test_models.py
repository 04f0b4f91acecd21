"""The fake engine's load and cache models (docs/behaviour.md "Fake engines"): prefix cache, prefill cost, batch FIFO,
``/metrics`` and the background load knob, as pure objects and through the engine's routes."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, Fleet, build_engine_app, main
from narwhal.fake_engine.batch import Scheduler
from narwhal.fake_engine.prefix import PrefixCache, prompt_text, text_tokens
from narwhal.fake_engine.state import EngineModel
from narwhal.testing.harness import FakeFleet
from tests.unit.fake_engine.fe_support import wait_for

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]
BLOCK_CHARS = 64  # 16 tokens of 4 characters
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}


def text_of(blocks: int, tag: str = "a") -> str:
    """``blocks`` full blocks of distinct text (block i differs from block j)."""
    return "".join(f"{tag}{i:03d}".ljust(BLOCK_CHARS, ".") for i in range(blocks))


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# -- the prefix cache, pure ------------------------------------------------------------------


def test_shared_prefix_hits_its_full_blocks_only() -> None:
    cache = PrefixCache(capacity=100)
    first = text_of(4) + "tail one"
    cache.insert(cache.block_hashes(first))
    assert len(cache) == 4  # the partial last block is never cached
    second = text_of(4) + "another, longer tail of the conversation...................."
    assert cache.lookup(cache.block_hashes(second), text_tokens(second)) == 4 * 16
    assert cache.lookup(cache.block_hashes(text_of(2)), text_tokens(text_of(2) + "x")) == 2 * 16


def test_a_block_hits_only_after_all_blocks_before_it() -> None:
    cache = PrefixCache(capacity=100)
    cache.insert(cache.block_hashes(text_of(3)))
    # Same blocks 1 and 2, a different block 0: nothing hits (chained hashes).
    changed = text_of(1, tag="b") + text_of(3)[BLOCK_CHARS:] + "x"
    assert cache.lookup(cache.block_hashes(changed), text_tokens(changed)) == 0


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    cache = PrefixCache(capacity=100)
    text = text_of(3)
    cache.insert(cache.block_hashes(text))
    assert text_tokens(text) == 48
    assert cache.lookup(cache.block_hashes(text), text_tokens(text)) == 32  # vLLM: num_tokens - 1 at most


def test_prompt_text_as_the_engine_sees_it() -> None:
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"text": "hi"}]}]}
    assert prompt_text(chat, chat=True) == "system\nbe brief\nuser\nhi\n"
    assert prompt_text({"prompt": ["first", "second"]}, chat=False) == "first"
    assert prompt_text({"prompt": [[1, 2], [3]]}, chat=False) == "1 2"
    assert prompt_text({"prompt": [5, 6]}, chat=False) == "5 6"
    assert text_tokens("") == 1 and text_tokens("abcde") == 2


# -- the scheduler, pure ---------------------------------------------------------------------


async def test_batch_limit_grants_slots_in_fifo_order() -> None:
    sched = Scheduler(max_num_seqs=1)
    await sched.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await sched.acquire()
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await wait_for(lambda: sched.waiting == 3)
    assert sched.running == 1
    tasks[1].cancel()  # a client that gave up leaves the queue
    await wait_for(lambda: sched.waiting == 2)
    for expected in ([0], [0, 2]):
        sched.release()
        await wait_for(lambda e=expected: order == e)  # type: ignore[misc]
        assert sched.running == 1
    assert sched.waiting == 0
    sched.release()
    assert sched.running == 0
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_raising_the_limit_admits_waiters_and_zero_means_no_limit() -> None:
    sched = Scheduler(max_num_seqs=1)
    await sched.acquire()
    waiters = [asyncio.create_task(sched.acquire()) for _ in range(2)]
    await wait_for(lambda: sched.waiting == 2)
    sched.set_limit(0)
    await asyncio.gather(*waiters)
    assert (sched.running, sched.waiting) == (3, 0)


async def test_prefill_cost_books_one_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills queue on the engine's single prefill lane: the second ends after the first."""
    slept: list[float] = []
    now = [100.0]

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("narwhal.fake_engine.batch.time.monotonic", lambda: now[0])
    monkeypatch.setattr("narwhal.fake_engine.batch.asyncio.sleep", fake_sleep)
    sched = Scheduler()
    await sched.prefill(0.5)
    await sched.prefill(0.25)
    now[0] = 101.0  # the lane is free again by now
    await sched.prefill(0.125)
    assert slept == [0.5, 0.75, 0.125]


# -- through the engine's routes ---------------------------------------------------------------


def cached_engine(**model: Any) -> FakeEngine:
    return FakeEngine("e0", load_model=EngineModel(prefix_cache=True, **model))


async def test_cached_tokens_reported_as_vllm_does(aiohttp_client: ClientFactory) -> None:
    engine = cached_engine(kv_blocks=1000)
    client = await aiohttp_client(build_engine_app(engine))
    system = text_of(8)  # 8 blocks, 128 tokens
    body = {"prompt": system + "question one", "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    first = await (await client.post("/v1/completions", json=body)).json()
    prompt_tokens = text_tokens(system + "question one")
    # A miss: vLLM leaves prompt_tokens_details unset (null), not cached_tokens 0.
    assert first["usage"]["prompt_tokens"] == prompt_tokens
    assert first["usage"]["prompt_tokens_details"] is None
    second = await (await client.post("/v1/completions", json={**body, "prompt": system + "question two"})).json()
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 128}
    stream = {"prompt": system + "q3", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    raw = await (await client.post("/v1/completions", json=stream)).read()
    usage_line = [line for line in raw.split(b"\n\n") if b'"choices":[]' in line][0]
    assert b'"prompt_tokens_details":{"cached_tokens":128}' in usage_line
    text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:prefix_cache_queries_total") == 2 * prompt_tokens + text_tokens(system + "q3")
    assert metric(text, "vllm:prefix_cache_hits_total") == 256.0
    assert engine.stats()["prefix_cache"] == {"blocks": 8, "queries": engine.prefix_queries, "hits": 256}


async def test_a_decode_with_remote_kv_computes_nothing(aiohttp_client: ClientFactory) -> None:
    producer, consumer = cached_engine(), cached_engine(prefill_s_per_token=0.5)
    consumer_client = await aiohttp_client(build_engine_app(consumer))
    producer_client = await aiohttp_client(build_engine_app(producer))
    pre = await (
        await producer_client.post("/v1/completions", json={"prompt": text_of(2), "kv_transfer_params": PREFILL_KV})
    ).json()
    decode = {"prompt": text_of(2), "max_tokens": 1, "kv_transfer_params": pre["kv_transfer_params"]}
    resp = await consumer_client.post("/v1/completions", json=decode)
    assert resp.status == 200
    assert consumer.prefix_queries == 0 and consumer.scheduler.free_at == 0.0  # no lookup, no prefill booked
    assert producer.prefix_queries == text_tokens(text_of(2))


async def test_prefill_cost_is_per_uncached_token(
    aiohttp_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    booked: list[float] = []

    async def spy(self: Scheduler, seconds: float) -> None:
        booked.append(seconds)

    monkeypatch.setattr(Scheduler, "prefill", spy)
    engine = cached_engine(prefill_s_per_token=0.001)
    client = await aiohttp_client(build_engine_app(engine))
    prompt = text_of(4) + "abcd"  # 65 tokens, 64 of them in full blocks
    for _ in range(2):
        assert (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).status == 200
    assert booked == pytest.approx([0.065, 0.001])
    engine.set_load_model(EngineModel(prefill_s_per_token=0.001))  # cache off: the words are the tokens
    await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 1})
    assert booked[-1] == pytest.approx(0.003)


async def test_queue_and_prefill_times_are_vllm_histograms_split_at_scheduling(
    aiohttp_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's RequestStateStats: queued → scheduled is the queue time, scheduled → first token the
    # prefill time. The fake's clock is the test's: arrival 10.0, its slot at 12.5, prefill done at 13.0.
    from narwhal.fake_engine import work
    from narwhal.supervisor.load_metrics import PrefillCounters, parse_prefill

    clock = iter([10.0, 12.5, 13.0])
    monkeypatch.setattr(work, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(clock))}))

    async def no_wait(self: Scheduler, seconds: float) -> None:
        pass

    monkeypatch.setattr(Scheduler, "prefill", no_wait)
    engine = cached_engine(prefill_s_per_token=0.001)
    client = await aiohttp_client(build_engine_app(engine))
    body = {"prompt": text_of(4) + "abcd", "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    assert (await client.post("/v1/completions", json=body)).status == 200
    text = await (await client.get("/metrics")).text()
    label = 'engine="0",model_name="' + engine.model + '"'
    for name, seconds, bucket in (("queue", 2.5, "2.5"), ("prefill", 0.5, "0.5")):
        series = f"vllm:request_{name}_time_seconds"
        assert f"# TYPE {series} histogram" in text
        assert f"{series}_count{{{label}}} 1.0" in text and f"{series}_sum{{{label}}} {seconds}" in text
        below = '0.3' if name == "prefill" else "2.0"
        assert f'{series}_bucket{{engine="0",le="{below}",model_name="{engine.model}"}} 0.0' in text
        assert f'{series}_bucket{{engine="0",le="{bucket}",model_name="{engine.model}"}} 1.0' in text
        assert f'{series}_bucket{{engine="0",le="+Inf",model_name="{engine.model}"}} 1.0' in text
    tokens = text_tokens(text_of(4) + "abcd")
    assert parse_prefill(text) == PrefillCounters(0.5, 1.0, float(tokens), 0.0)  # what the supervisor reads


async def test_requests_beyond_the_batch_wait_and_show_in_metrics(aiohttp_client: ClientFactory) -> None:
    engine = FakeEngine("e0", load_model=EngineModel(max_num_seqs=1))
    client = await aiohttp_client(build_engine_app(engine))
    hold = {"prompt": "x", "stream": True, "max_tokens": 200, "narwhal_fake": {"decode": {"token_delay_s": 0.05}}}
    first = await client.post("/v1/completions", json=hold)
    await first.content.readuntil(b"\n\n")  # it runs
    second = asyncio.create_task(client.post("/v1/completions", json={"prompt": "y", "max_tokens": 1}))
    await wait_for(lambda: engine.scheduler.waiting == 1)
    text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:num_requests_running") == 1.0
    assert metric(text, "vllm:num_requests_waiting") == 1.0
    assert not second.done()
    first.close()  # the running request ends (aborted): the waiting one gets its slot
    resp = await asyncio.wait_for(second, 10)
    assert resp.status == 200
    await wait_for(lambda: engine.scheduler.running == 0)
    text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:num_requests_running") == 0.0 and metric(text, "vllm:num_requests_waiting") == 0.0


async def test_kv_cache_usage_counts_blocks_in_use(aiohttp_client: ClientFactory) -> None:
    engine = FakeEngine("e0", load_model=EngineModel(kv_blocks=10))
    client = await aiohttp_client(build_engine_app(engine))
    body = {"prompt": " ".join(["w"] * 64), "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    await client.post("/v1/completions", json=body)  # 64 tokens: 4 held blocks of 10
    text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.4
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert "# TYPE vllm:prefix_cache_queries_created gauge" in text


async def test_running_requests_sharing_a_prefix_use_its_blocks_once(aiohttp_client: ClientFactory) -> None:
    # vLLM's block pool: a cached block is one block of kv_cache_usage_perc however many running
    # requests hit it; each request's partial tail is its own.
    engine = cached_engine(kv_blocks=100)
    client = await aiohttp_client(build_engine_app(engine))
    slow = {"decode": {"token_delay_s": 0.05}}
    streams = []
    for tail in ("first question", "second question"):  # 8 shared full blocks, then a tail each
        body = {"prompt": text_of(8) + tail, "stream": True, "max_tokens": 200, "narwhal_fake": slow}
        resp = await client.post("/v1/completions", json=body)
        await resp.content.readuntil(b"\n\n")  # it runs, holding its blocks
        streams.append(resp)
    assert engine.blocks_in_use() == 8  # the tails are under a block: 8, not 16
    text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.08
    other = {"prompt": text_of(4, tag="b"), "stream": True, "max_tokens": 200, "narwhal_fake": slow}
    streams.append(await client.post("/v1/completions", json=other))
    await streams[-1].content.readuntil(b"\n\n")
    assert engine.blocks_in_use() == 12  # another prefix: its own 4 blocks
    for resp in streams:
        resp.close()
    await wait_for(lambda: engine.scheduler.running == 0)
    assert engine.blocks_in_use() == 0 and engine.cache is not None and engine.cache.in_use == 0


# -- the control server: background load and the models at runtime --------------------------------


async def test_background_load_occupies_slots_until_stopped() -> None:
    fleet = Fleet(["a"], load_model=EngineModel(max_num_seqs=2))
    ready = await fleet.start()
    engine = fleet.engines["a"]
    ctl, url = ready["control"], ready["engines"]["a"]
    try:
        async with aiohttp.ClientSession() as s:
            put = await s.put(f"{ctl}/engines/a/background", json={"requests": 3, "hold_s": 60})
            assert put.status == 200 and await put.json() == {"name": "a", "requests": 3, "hold_s": 60.0}
            await wait_for(lambda: engine.scheduler.running == 2 and engine.scheduler.waiting == 1)
            text = await (await s.get(f"{url}/metrics")).text()
            assert metric(text, "vllm:num_requests_running") == 2.0
            assert metric(text, "vllm:num_requests_waiting") == 1.0
            # A real request queues behind the background ones.
            real = asyncio.create_task(s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}))
            await wait_for(lambda: engine.scheduler.waiting == 2)
            assert (await s.put(f"{ctl}/engines/a/background", json={"requests": -1})).status == 400
            assert (await s.put(f"{ctl}/engines/a/background", json={"requests": 1, "x": 1})).status == 400
            cleared = await (await s.delete(f"{ctl}/engines/a/background")).json()
            assert cleared == {"name": "a", "requests": 0, "hold_s": None}
            assert (await asyncio.wait_for(real, 10)).status == 200
            await wait_for(lambda: engine.scheduler.running == 0)
            assert engine.scheduler.waiting == 0
            await s.put(f"{ctl}/engines/a/background", json={"requests": 1})
            assert (await (await s.get(f"{ctl}/engines/a/background")).json())["hold_s"] == 1.0
            await s.put(f"{ctl}/engines/a/background", json={"requests": 0})
            assert engine.scheduler.running == 0 and engine.background.requests == 0
    finally:
        await fleet.close()


async def test_models_set_at_runtime_through_the_control_server() -> None:
    fleet = Fleet(["a", "b"])
    ready = await fleet.start()
    ctl = ready["control"]
    try:
        async with aiohttp.ClientSession() as s:
            view = await (await s.get(f"{ctl}/engines/a/model")).json()
            assert view["model"] == EngineModel().model_dump()  # all off by default
            put = await s.put(f"{ctl}/engines/a/model", json={"prefix_cache": True, "max_num_seqs": 4})
            assert (await put.json())["model"]["max_num_seqs"] == 4
            assert fleet.engines["a"].cache is not None and fleet.engines["b"].cache is None
            assert fleet.engines["a"].load_model.prefix_cache is True
            for bad in ({"max_num_seqs": -1}, {"nope": 1}, [1]):
                assert (await s.put(f"{ctl}/engines/a/model", json=bad)).status == 400
            assert fleet.engines["a"].load_model.max_num_seqs == 4
            stats = await (await s.get(f"{ctl}/engines/a/stats")).json()
            assert stats["scheduler"] == {"running": 0, "waiting": 0, "background": 0, "background_served": 0}
    finally:
        await fleet.close()


def test_the_cli_refuses_a_bad_model_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-num-seqs", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "narwhal fake-engine: --max-num-seqs: Input should be greater than or equal to 0\n"


def test_fleet_process_models_from_the_cli_and_the_harness() -> None:
    """The ``narwhal fake-engine`` process: models from its options, background load at runtime."""
    fleet = FakeFleet.start(["p0", "d0"], args=["--prefix-cache", "--max-num-seqs", "2", "--kv-blocks", "64"])
    try:
        assert fleet.stats("p0")["model"] == EngineModel(prefix_cache=True, max_num_seqs=2, kv_blocks=64).model_dump()
        fleet.set_background("d0", 3, hold_s=60)

        def reading() -> tuple[float, float]:
            with urllib.request.urlopen(fleet.engines["d0"] + "/metrics", timeout=5) as resp:
                text = resp.read().decode()
            return metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")

        deadline = time.monotonic() + 10
        while reading() != (2.0, 1.0):
            assert time.monotonic() < deadline, reading()
            time.sleep(0.05)
        assert fleet.stats("p0")["scheduler"]["running"] == 0  # only d0 is busy
        fleet.set_background("d0", 0)
        assert reading() == (0.0, 0.0)
        assert fleet.set_model("p0", prefix_cache=False)["model"]["prefix_cache"] is False
    finally:
        fleet.stop()
