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
from tests.real_vllm.engines import MODEL, RealEngine, metric
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


async def test_a_consumers_4xx_passes_through_and_its_vllm_frees_the_blocks(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    producer, consumer = real_pair
    before = value(at_rest(real_router, RELEASED), RELEASED)
    body = {"model": MODEL, "prompt": prompt(), "max_tokens": 5000, "stream": True}  # beyond the 2,048 context
    reply = await send(real_router.url, "/v1/completions", body)
    assert reply.status == 400, reply.raw
    error = reply.json["error"]
    assert error["message"].startswith("max_tokens=5000 cannot be greater than max_model_len=2048."), error
    assert (error["param"], error["code"]) == ("max_tokens", 400)  # vLLM's param, kept
    # The refusal was raised inside vLLM's completions handler: the consumer tells the producer
    # to free the blocks (at its next step), so Narwhal sends no second word.
    ok = await send(real_router.url, "/v1/completions", {"model": MODEL, "prompt": prompt(), "max_tokens": 2})
    assert ok.status == 200, ok.raw
    await until(lambda: kv_usage(producer) == 0.0, "the producer's blocks freed")
    assert value(at_rest(real_router, RELEASED), RELEASED) == before
    assert "Potentially invalid KV blocks" not in producer.log()  # no late read


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
