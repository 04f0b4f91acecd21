"""docs/behaviour.md "Placement" through real gunicorn: a producer slower by its own ``/metrics`` (the engine-reported
prefill rate, ``supervisor.holdings.engine_rate``) takes fewer homes, so every replica sends it less.

The fleet: two producers with the fake's prefix cache at 160 blocks of 16 tokens (40 of our
256-character blocks at 4 characters a token: 36 of room for homes, two prefixes of 15), one
prefilling 100× slower than the other, and a consumer. 100×, not a real GPU's 2×: both fakes run
on one event loop on a loaded host, where a 1 ms prefill's sleep can take several, and the fast
one's reported rate must stay above 4× the slow one's whatever that costs it. The engines' rates
come from their own counters, whoever sends the prefills: here also the test itself, straight to
each fake (another client's traffic), so that enough spans of prefills finish at each."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.placement.holdings import holdings_support as hs
from tests.real_gunicorn.support import MODEL, TOKEN, completion, engine_entry, start_router

PRODUCERS = ("eslow", "efast")
DIRECT = 12  # prefills sent straight to each fake per round
# Their prompts: 100 tokens (6 blocks) at the fast one, 1 ms; 20 (1 block) at the slow one, 20 ms.
# 72 blocks a round at most, beside the prefixes' 30 in 160: least recently used, they go first.
DIRECT_CHARS = {"efast": 400, "eslow": 80}


async def _homes(router: RouterProcess) -> dict[str, int]:
    """``/admin/engines``' count of homes per producer (none published: 0)."""
    return {n: ((await engine_entry(router, n))["holdings"] or {}).get("homes", 0) for n in PRODUCERS}


async def _until(router: RouterProcess, want: dict[str, int], step: Callable[[], Awaitable[None]],
                 timeout: float = 30) -> None:
    """``step`` again and again until the homes are ``want`` (bounded by ``timeout``)."""
    end = asyncio.get_running_loop().time() + timeout
    while True:
        await step()
        homes = await _homes(router)
        if homes == want:
            return
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"homes {homes}, waiting for {want}")


def _ranked_first(name: str) -> str:
    while True:
        prefix = hs.make_prefix()
        if rank(list(PRODUCERS), PrefixBlocks(prefix, 256, 65536).key(0), key_hash)[0] == name:
            return prefix


async def test_a_producer_slower_by_its_engine_metrics_takes_fewer_homes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    fleet = FakeFleet.start([*PRODUCERS, "ed0"], args=[
        "--model", MODEL, "--prefix-cache", "--kv-blocks", str(hs.KV_BLOCKS),
        "--prefill-us-per-token", "10", "--prefill-us-per-token", "eslow=1000"])
    engines = [{"name": n, "role": "producer"} for n in PRODUCERS] + [{"name": "ed0", "role": "consumer"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("erate"), server={"workers": 1, "admin_token": TOKEN},
                        placement={"load_interval_s": 0.1, "held": {"affinity_slack": 0.5}})
    prefixes = [_ranked_first("eslow") for _ in range(2)]  # both rank the slow producer first
    sent = 0
    try:
        async with aiohttp.ClientSession() as session:
            async def keep_live() -> None:  # each prefix reused within HOT_S: live, so homed
                for prefix in prefixes:
                    await hs.ask(session, proc, prefix + " q")

            async def direct(name: str) -> None:
                # One at a time: a burst would have each prefill wait on the lane behind the others,
                # which the engine counts as prefill time (``engine_rate`` says why that reads low).
                nonlocal sent
                for _ in range(DIRECT):
                    sent += 1  # a prompt of its own, in blocks nobody reuses
                    prompt = f"{sent:06d} " + "direct traffic, computed once. " * 13
                    body = completion(prompt[:DIRECT_CHARS[name]], stream=False, max_tokens=1)
                    async with session.post(fleet.engines[name] + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.read()

            async def with_traffic() -> None:
                await asyncio.gather(*(direct(n) for n in PRODUCERS))
                await keep_live()

            # No engine has reported a rate yet: rooms unscaled, both prefixes homed where they rank first.
            await _until(proc, {"eslow": 2, "efast": 0}, keep_live)
            # Once both engines' counters show enough prefills, the slow one's rate class is 1/4 of
            # the fast one's: 9 blocks of room, no prefix of 15; the fast one takes both.
            await _until(proc, {"eslow": 0, "efast": 2}, with_traffic)
            for _ in range(3):  # and it stays so while the traffic goes on
                await with_traffic()
                assert await _homes(proc) == {"eslow": 0, "efast": 2}
        assert fleet.stats("efast")["prefix_cache"]["hits"] > 0  # the fast one serves the prefixes, from its cache
    finally:
        proc.stop()
        fleet.stop()
