"""Handoffs that are not decoded, on real engines: a consumer's refusal and a released handoff.

The producer's own ``/metrics`` are the judge: ``vllm:kv_cache_usage_perc`` counts the blocks a
handoff pins (an idle engine with prefix caching still reads 0: cached blocks nobody uses are
free), and the consumer's ``vllm:nixl_xfer_time_seconds_count`` counts its NIXL reads.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from narwhal.testing.harness import RouterProcess
from tests.real_gunicorn.support import admin, at_rest, send, value
from tests.real_vllm.conftest import needs_transfer
from tests.real_vllm.engines import MODEL, RealEngine, metric, post
from tests.real_vllm.test_real_pd import kv_reads, prompt

pytestmark = pytest.mark.timeout(300)
RELEASED = "narwhal_handoffs_released_total"


def kv_usage(engine: RealEngine) -> float:
    return metric(engine.metrics(), "vllm:kv_cache_usage_perc")


async def until(check: object, what: str, bound_s: float = 60.0) -> None:
    end = time.monotonic() + bound_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < end, f"timed out after {bound_s:g}s waiting for {what}"
        await asyncio.sleep(0.2)


async def test_a_limit_past_the_context_is_refused_before_any_prefill(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    """``max_tokens`` past the model's ``max_model_len`` (which the engines' ``/v1/models`` give):
    the one-token prefill could not see it and the consumer refused it only after a handoff
    existed (then, on real engines, the next decode of the prompt stalled for the lease). The
    router refuses it first, with vLLM's own message and param, and no engine is asked."""
    producer = real_pair[0]
    before = [metric(e.metrics(), "vllm:prompt_tokens_total") for e in real_pair]
    body = {"model": MODEL, "prompt": prompt(), "max_tokens": 5000, "stream": True}  # beyond the 2,048 context
    reply = await send(real_router.url, "/v1/completions", body)
    assert reply.status == 400, reply.raw
    error = reply.json["error"]
    assert error["message"].startswith("max_tokens=5000 cannot be greater than max_model_len=2048."), error
    assert (error["param"], error["code"]) == ("max_tokens", 400)  # vLLM's param
    assert [metric(e.metrics(), "vllm:prompt_tokens_total") for e in real_pair] == before  # nothing prefilled
    # The same prompt right after decodes at once: no handoff is pinned, nothing stalls.
    started = time.monotonic()
    ok = await send(real_router.url, "/v1/completions", {**body, "max_tokens": 2})
    assert ok.status == 200 and ok.events[-1] == b"[DONE]", ok.raw
    assert time.monotonic() - started < 20
    await until(lambda: kv_usage(producer) == 0.0, "the producer's blocks freed")


async def test_a_client_handoff_in_vllm_xargs_never_reaches_a_real_producer(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    """vLLM builds the sampling ``extra_args`` from ``vllm_xargs`` and keeps its
    ``kv_transfer_params`` when the body has none: a real producer fails on a client's. Through
    Narwhal it is stripped on every leg, and no engine is charged."""
    producer, _ = real_pair
    body = {"model": MODEL, "prompt": prompt(), "max_tokens": 2, "vllm_xargs": {"kv_transfer_params": "x"}}
    direct = await asyncio.to_thread(post, producer.url + "/v1/completions", body, 120)
    assert direct[0] >= 400, direct  # what the engine does with it when it does reach it
    reply = await send(real_router.url, "/v1/completions", {**body, "stream": True})
    assert reply.status == 200 and reply.events[-1] == b"[DONE]", reply.raw
    entries = {e["name"]: e for e in (await admin(real_router))["engines"]}
    assert all(e["failure_streak"] == 0 for e in entries.values()), entries


async def test_a_handoff_whose_client_left_is_released_and_read(
    real_router: RouterProcess, real_pair: list[RealEngine], nixl_moves: str | None
) -> None:
    """The client leaves while the producer prefills (held still with SIGSTOP, so the order is
    certain): the prefill ends in the background and its handoff is released, a one-token decode
    that makes the consumer read (and the producer free) the blocks at once, not at the lease."""
    needs_transfer(nixl_moves)
    producer, consumer = real_pair
    reads = kv_reads(consumer)
    before = value(at_rest(real_router, RELEASED), RELEASED)
    assert producer.proc is not None
    os.kill(producer.proc.pid, signal.SIGSTOP)  # the API server only: it reads no request now
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": prompt(), "max_tokens": 8, "stream": True}
            task = asyncio.ensure_future(session.post(real_router.url + "/v1/completions", json=body))
            end = time.monotonic() + 30
            while not await _prefilling(real_router, producer.name):
                assert time.monotonic() < end, "the prefill never left the router"
                await asyncio.sleep(0.05)
            task.cancel()  # the client goes away mid-prefill
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
    await until(lambda: kv_reads(consumer) == reads + 1, "the release's NIXL read on the consumer")
    await until(lambda: kv_usage(producer) == 0.0, "the producer's blocks freed")
    assert value(at_rest(real_router, RELEASED), RELEASED) == before + 1


async def _prefilling(router: RouterProcess, name: str) -> bool:
    entry = next(e for e in (await admin(router))["engines"] if e["name"] == name)
    return bool(entry["inflight"]["prefill"] >= 1)
