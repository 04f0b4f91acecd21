"""docs/behaviour.md "Placement" through real gunicorn, corrections: an eviction the engine's cached tokens reveal
(``over``), after which a prefix moves; a restarted producer; a restarted supervisor
(``holdings_support`` says what the fleet is)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import aiohttp
import pytest

from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles
from tests.real_gunicorn.placement.holdings import holdings_support as hs
from tests.real_gunicorn.placement.holdings.holdings_support import BLOCKS
from tests.real_gunicorn.support import wait_until


async def test_after_the_producer_evicts_the_next_prefill_is_over_and_lowers_its_holdings(
    fresh: tuple[RouterProcess, FakeFleet],
) -> None:
    router, hfleet = fresh
    async with aiohttp.ClientSession() as session:
        prefix = hs.make_prefix()
        holder = (await hs.ask(session, router, prefix + " one"))["producer"]
        # A hit, so the holder has reported cached tokens: from then on a prefill that reports
        # none is judged as nothing cached (before, an absent field may mean an older vLLM).
        await hs.wait_blocks(router, holder, lambda n: n >= BLOCKS, "the prefix published")
        assert (await hs.ask(session, router, prefix + " again"))["cached_tokens"] >= BLOCKS * 64
        other = hs.make_prefix()
        while hs.favourites(other)[0] != holder:
            other = hs.make_prefix()
        assert (await hs.ask(session, router, other + " two"))["producer"] == holder
        await hs.wait_blocks(router, holder, lambda n: n >= 2 * BLOCKS, "both prefixes published")
        hfleet.set_model(holder, prefix_cache=False)  # the engine's cache emptied behind the router's back
        hfleet.set_model(holder, prefix_cache=True)
        before = hs.predictions(router)
        line = await hs.ask(session, router, other + " three")
        assert (line["producer"], line["predicted_cached_chars"], line["cached_tokens"] or 0) == (
            holder, BLOCKS * 256, 0)  # nothing hit: vLLM leaves the details out
        assert hs.delta(router, before, {"exact": 0, "over": 1, "under": 0}) == {"exact": 0, "over": 1, "under": 0}
        # Its first block was gone, so was everything used before it (the other prefix): only
        # what this prefill put back is believed held.
        await hs.wait_blocks(router, holder, lambda n: n == BLOCKS, "the evicted prefix forgotten")
        line = await hs.ask(session, router, prefix + " four")
        assert line["predicted_cached_chars"] == 0 and not line["cached_tokens"]


async def test_a_smaller_cache_the_router_has_not_seen_shows_as_over_and_the_other_prefix_moves(
    fresh: tuple[RouterProcess, FakeFleet],
) -> None:
    """Two live prefixes on one producer; its KV cut to one prefix's worth and emptied. The next
    prefill of one of them reports nothing cached where both were predicted (``over``), the
    holdings there drop to what that prefill put back, and the other prefix, which no longer
    fits beside it, is placed on another producer (its home moved, docs/behaviour.md "Placement" / README)."""
    router, hfleet = fresh
    stays, moves = _two_prefixes_ranking_the_same_producer_first()
    holder = hs.favourites(stays)[0]
    async with aiohttp.ClientSession() as session:
        for prefix in (moves, stays):
            for question in (" one", " again"):  # twice each: live, homed, and a hit reported
                line = await hs.ask(session, router, prefix + question)
                assert line["producer"] == holder, line
            await hs.wait_blocks(router, holder, lambda n: n >= BLOCKS, "published")
        await _wait_holdings(router, holder, lambda h: h["homes"] == 2, "both homed there")
        # 70 blocks of 16 tokens: one prefix's worth; the cache emptied behind the router's back.
        hfleet.set_model(holder, prefix_cache=False)
        hfleet.set_model(holder, prefix_cache=True, kv_blocks=70)
        await _wait_holdings(router, holder, lambda h: h["capacity_blocks"] and h["capacity_blocks"] < 2 * BLOCKS
                             and h["homes"] == 1, "the smaller capacity read, one home left")
        before = hs.predictions(router)
        line = await hs.ask(session, router, stays + " three")
        assert (line["producer"], line["predicted_cached_chars"], line["cached_tokens"] or 0) == (
            holder, BLOCKS * 256, 0)
        assert hs.delta(router, before, {"exact": 0, "over": 1, "under": 0}) == {"exact": 0, "over": 1, "under": 0}
        await hs.wait_blocks(router, holder, lambda n: n == BLOCKS, "only what this prefill put back")
        line = await hs.ask(session, router, moves + " four")
    assert line["producer"] == hs.favourites(moves)[1] != holder, line


def _two_prefixes_ranking_the_same_producer_first() -> tuple[str, str]:
    """Two prefixes whose rendezvous favourite is the same producer, the one that keeps its home
    when only one fits there first (homes are given in order of first block key)."""
    first = hs.make_prefix()
    while True:
        second = hs.make_prefix()
        if hs.favourites(second)[0] == hs.favourites(first)[0]:
            keys = [PrefixBlocks(p, 256, 65536).key(0) for p in (first, second)]
            return (first, second) if keys[0] < keys[1] else (second, first)


async def _wait_holdings(router: RouterProcess, name: str, check: Any, what: str, timeout: float = 10) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not check(await hs.holdings(router, name)):
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"{name}: {what}; holdings {await hs.holdings(router, name)}")
        await asyncio.sleep(0.05)


async def test_a_restarted_producer_loses_its_holdings(router: RouterProcess, hfleet: FakeFleet) -> None:
    async with aiohttp.ClientSession() as session:
        prefix = hs.make_prefix()
        holder = (await hs.ask(session, router, prefix + " one"))["producer"]
        await hs.wait_blocks(router, holder, lambda n: n >= BLOCKS, "published")
        # A hit first, so the holder has reported cached tokens (then an answer without them is
        # judged as none cached), whatever this module's tests ran before.
        assert (await hs.ask(session, router, prefix + " again"))["cached_tokens"] >= BLOCKS * 64
        hfleet.control_request("POST", f"/engines/{holder}/stop")
        hfleet.control_request("POST", f"/engines/{holder}/start?restart=1")  # a new engine id, an empty cache
        before = hs.predictions(router)
        line = await hs.ask(session, router, prefix + " two")
        assert (line["producer"], line["predicted_cached_chars"], line["cached_tokens"] or 0) == (
            holder, BLOCKS * 256, 0)  # nothing hit: vLLM leaves the details out
        # The new engine id drops everything the old engine held: not an eviction to learn from.
        assert hs.delta(router, before, {"exact": 1, "over": 0, "under": 0}) == {"exact": 1, "over": 0, "under": 0}
        await hs.wait_blocks(router, holder, lambda n: n == BLOCKS, "only what the new engine computed")


async def test_a_restarted_supervisor_keeps_the_holdings(
    hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    proc = hs.start(hfleet, tmp_path_factory.mktemp("restart"), workers=1)
    try:
        async with aiohttp.ClientSession() as session:
            prefix = hs.make_prefix()
            holder = (await hs.ask(session, proc, prefix + " one"))["producer"]
            await hs.wait_blocks(proc, holder, lambda n: n == BLOCKS, "published")
            (old,) = router_roles(proc.proc.pid)["supervisor"]
            os.kill(old, signal.SIGKILL)
            wait_until(lambda: [p for p in router_roles(proc.proc.pid)["supervisor"] if p != old], 15,
                       "a new supervisor")
            other = hs.make_prefix()
            while hs.favourites(other)[0] != holder:
                other = hs.make_prefix()
            assert (await hs.ask(session, proc, other + " two"))["producer"] == holder
            # The new supervisor started from the published section: both prefixes, not only the new one.
            await hs.wait_blocks(proc, holder, lambda n: n == 2 * BLOCKS, "both prefixes")
            line = await hs.ask(session, proc, prefix + " three")
            assert (line["producer"], line["predicted_cached_chars"]) == (holder, BLOCKS * 256)
    finally:
        proc.stop()
