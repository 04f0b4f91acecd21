"""docs/behaviour.md "Placement" through real gunicorn, bounds: capacity from ``vllm:cache_config_info``, the slots
without it, a full table, and a slower producer's learned rate (``holdings_support`` says what
the fleet is)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.placement.holdings import holdings_support as hs
from tests.real_gunicorn.placement.holdings.holdings_support import KV_BLOCKS, PRODUCERS
from tests.real_gunicorn.support import MODEL, TOKEN, engine_entry, start_router


async def test_capacity_is_read_from_cache_config_info(router: RouterProcess, hfleet: FakeFleet) -> None:
    name = PRODUCERS[0]

    def capacity(held: dict[str, Any], kv_blocks: int) -> int:
        return int(kv_blocks * 16 * (held.get("chars_per_token") or 4.0)) // 256

    async def until_capacity(kv_blocks: int) -> dict[str, Any]:
        end = asyncio.get_running_loop().time() + 10
        while True:
            held = await hs.holdings(router, name)
            if held["capacity_blocks"] == capacity(held, kv_blocks) or asyncio.get_running_loop().time() > end:
                return held
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession() as session:
        prefix = hs.make_prefix()
        while hs.favourites(prefix)[0] != name:
            prefix = hs.make_prefix()
        await hs.ask(session, router, prefix + " q")
    held = await until_capacity(KV_BLOCKS)
    assert held["capacity_blocks"] == capacity(held, KV_BLOCKS)
    try:
        hfleet.set_model(name, kv_blocks=40)  # smaller than one prefix: the holdings shrink to it
        held = await until_capacity(40)
        assert held["capacity_blocks"] == capacity(held, 40) and held["blocks"] <= held["capacity_blocks"]
    finally:
        hfleet.set_model(name, kv_blocks=KV_BLOCKS)


async def test_without_cache_config_info_holdings_are_bounded_by_the_slots(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An engine whose ``/metrics`` has no ``vllm:cache_config_info`` (older vLLM): no capacity
    known, so a producer's holdings are bounded by its share of ``placement.held.holdings_slots``
    (80 for 4 producers: 20 keys each), whatever the engine holds."""
    fakes = hs.start_fleet()
    for name in PRODUCERS:
        fakes.set_model(name, cache_config_info=False)
    proc = hs.start(fakes, tmp_path_factory.mktemp("noinfo"), workers=1, held={"holdings_slots": 80})
    try:
        long_prompt = hs.make_prefix() + hs.make_prefix()  # 30 blocks: more than the 20 slots
        async with aiohttp.ClientSession() as session:
            holder = (await hs.ask(session, proc, long_prompt + " q"))["producer"]
            held = await hs.wait_blocks(proc, holder, lambda n: n == 20, "cut to the slots")
            assert held["capacity_blocks"] is None
            # The prompt's tail went first (as vLLM evicts it): its head is still believed held.
            line = await hs.ask(session, proc, long_prompt + " again")
        assert (line["producer"], line["predicted_cached_chars"]) == (holder, 20 * 256)
    finally:
        proc.stop()
        fakes.stop()


async def test_a_full_table_forgets_the_oldest_keys_without_an_error(
    hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # 40 slots for 4 producers: 10 keys each, fewer than one prefix's 15 blocks.
    proc = hs.start(hfleet, tmp_path_factory.mktemp("slots"), workers=1, held={"holdings_slots": 40})
    try:
        async with aiohttp.ClientSession() as session:
            prefix = hs.make_prefix()
            holder = (await hs.ask(session, proc, prefix + " one"))["producer"]
            await hs.wait_blocks(proc, holder, lambda n: n == 10, "cut to the room")
            # The prompt's tail went first (as vLLM evicts it): its head is still believed held.
            line = await hs.ask(session, proc, prefix + " two")
            assert (line["producer"], line["predicted_cached_chars"]) == (holder, 10 * 256)
    finally:
        proc.stop()


async def test_a_slower_producer_gets_fewer_new_prefixes_once_its_rate_is_learned(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two producers, one prefilling 10× slower (as an older GPU; 10× so that a loaded host's round
    trips cannot blur the rates learned from one prefill each): once each has prefilled with
    nothing queued ahead, a prefix nobody holds goes to the fast one even where rank prefers the
    slow one (10× the estimate is far beyond the slack)."""
    names = ["rslow", "rfast", "rd0"]
    fleet = FakeFleet.start(names, args=["--model", MODEL, "--prefix-cache", "--prefill-us-per-token", "10",
                                         "--prefill-us-per-token", "rslow=100"])
    engines = [{"name": "rslow", "role": "producer"}, {"name": "rfast", "role": "producer"},
               {"name": "rd0", "role": "consumer"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("slow"), server={"workers": 1, "admin_token": TOKEN},
                        placement={"load_interval_s": 0.1, "held": {"affinity_slack": 0.5}})
    try:
        def ranked_first(name: str) -> str:
            while True:
                prefix = hs.make_prefix()
                if rank(["rslow", "rfast"], PrefixBlocks(prefix, 256, 65536).key(0), key_hash)[0] == name:
                    return prefix

        async with aiohttp.ClientSession() as session:
            for name in ("rslow", "rfast"):  # one clean prefill each: both rates learned
                assert (await hs.ask(session, proc, ranked_first(name) + " q"))["producer"] == name
            for name in ("rslow", "rfast"):
                await _wait_rate(proc, name)
            rates = {n: (await engine_entry(proc, n))["holdings"]["prefill_chars_per_s"] for n in ("rslow", "rfast")}
            assert rates["rfast"] > 2 * rates["rslow"], rates
            chosen = [(await hs.ask(session, proc, ranked_first("rslow") + " q"))["producer"] for _ in range(4)]
        assert chosen == ["rfast"] * 4
    finally:
        proc.stop()
        fleet.stop()


async def _wait_rate(router: RouterProcess, name: str, timeout: float = 10) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not ((await engine_entry(router, name))["holdings"] or {}).get("prefill_chars_per_s"):
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"{name}: no prefill rate learned")
        await asyncio.sleep(0.05)
