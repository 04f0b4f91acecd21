"""SPEC §3.3 through real gunicorn: holdings shared by every worker, learned from what was sent and
corrected by the engines' cached tokens, bounded by ``cache_config_info``, dropped on restart;
the ``held`` policy's choices and their counters.

Its own fleet: 4 producers with the fake's prefix cache at 160 blocks of 16 tokens (2,560 tokens,
10,240 characters: two 3,900-character system prompts fit, three do not) and 2 consumers. Each
test makes prefixes of its own (a fresh tag), so their holdings are theirs. Every producer
prefills at the same cost (10 µs an uncached token), and the router runs with
``affinity_slack = 0.5``: a learned rate still carries the round trip's noise on a loaded box, and
the rank (what these tests predict) must decide between equal producers that hold nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    access_line,
    admin,
    completion,
    engine_entry,
    scrape,
    sessions_per_worker,
    settled,
    start_router,
    value,
    wait_state,
    wait_until,
)

PRODUCERS = ["hp0", "hp1", "hp2", "hp3"]
CONSUMERS = ["hd0", "hd1"]
PREFIX_CHARS = 3900  # 15 blocks of 256; a prompt of it and a short question keys exactly those
BLOCKS = PREFIX_CHARS // 256
KV_BLOCKS = 160


def _engines() -> list[dict[str, Any]]:
    return [{"name": n, "role": "producer"} for n in PRODUCERS] + [{"name": n, "role": "consumer"} for n in CONSUMERS]


def _fleet() -> FakeFleet:
    return FakeFleet.start(PRODUCERS + CONSUMERS, args=["--model", MODEL, "--lease-s", "120", "--prefix-cache",
                                                        "--kv-blocks", str(KV_BLOCKS), "--prefill-us-per-token", "10"])


@pytest.fixture(scope="module")
def hfleet() -> Iterator[FakeFleet]:
    started = _fleet()
    yield started
    started.stop()


@pytest.fixture
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, FakeFleet]]:
    """A fleet and router of their own, nothing held and nothing learned: for the tests whose
    choices depend on which producers are full (``held.eviction_weight``), which the module's
    shared fleet fills as its tests go."""
    fleet = _fleet()
    try:
        proc = _router(fleet, tmp_path_factory.mktemp("fresh"))
        yield proc, fleet
        proc.stop()
    finally:
        fleet.stop()


def _router(hfleet: FakeFleet, tmp: Any, workers: int = 2, **placement: Any) -> RouterProcess:
    return start_router(hfleet, _engines(), tmp, server={"workers": workers, "admin_token": TOKEN},
                        placement={"load_interval_s": 0.1, "affinity_slack": 0.5, **placement})


@pytest.fixture(scope="module")
def router(hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = _router(hfleet, tmp_path_factory.mktemp("holdings"))
    yield proc
    proc.stop()


def _prefix(tag: str) -> str:
    text = tag + " " + "".join(f"system rule {i:03d}: answer as the house style says. " for i in range(100))
    return text[:PREFIX_CHARS]


def _favourites(prefix: str) -> list[str]:
    """The producers in rendezvous rank of the prompt's first block key: who places it first."""
    return rank(list(PRODUCERS), PrefixBlocks(prefix, 256, 65536).key(0), key_hash)


async def _ask(session: aiohttp.ClientSession, router: RouterProcess, prompt: str) -> dict[str, Any]:
    """One completion through ``session``'s worker; its access-log line."""
    rid = f"held-{uuid.uuid4().hex}"
    async with session.post(router.url + "/v1/completions", json=completion(prompt, stream=False),
                            headers={"x-request-id": rid}) as resp:
        assert resp.status == 200, await resp.read()
    return access_line(router, rid)


async def _holdings(router: RouterProcess, name: str) -> dict[str, Any]:
    entry = await engine_entry(router, name)
    return dict(entry["holdings"] or {"blocks": 0, "capacity_blocks": None})


async def _wait_blocks(router: RouterProcess, name: str, check: Any, what: str, timeout: float = 10) -> dict:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        held = await _holdings(router, name)
        if check(held["blocks"]):
            return held
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"{name}: {what}; holdings {held}")
        await asyncio.sleep(0.05)


def _predictions(router: RouterProcess) -> dict[str, float]:
    text = scrape(router)
    return {r: value(text, "narwhal_holdings_predictions_total", result=r) for r in ("exact", "over", "under")}


def _delta(router: RouterProcess, before: dict[str, float], expected: dict[str, float]) -> dict[str, float]:
    def read() -> dict[str, float]:
        now = _predictions(router)
        return {r: now[r] - before[r] for r in now}

    return dict(settled(read, expected))


async def test_a_prefix_prefilled_through_one_worker_is_placed_on_its_producer_by_the_other(
    router: RouterProcess,
) -> None:
    prefix = _prefix(uuid.uuid4().hex)
    favourite = _favourites(prefix)[0]
    # The favourite out while the first worker places the prefix: it goes to the second in rank.
    await admin(router, "POST", f"/admin/engines/{favourite}/eject")
    try:
        async with sessions_per_worker(router, 2) as sessions:
            first_worker, second_worker = sessions.values()
            first = await _ask(first_worker, router, prefix + " first question")
            holder = first["producer"]
            assert holder == _favourites(prefix)[1] and first["predicted_cached_chars"] == 0
            await admin(router, "POST", f"/admin/engines/{favourite}/readmit")
            await wait_state(router, favourite, "admitted")
            await _wait_blocks(router, holder, lambda n: n >= BLOCKS, "the first prefill's blocks published")
            # Rank alone would now send it to the favourite; the holdings send it where it is.
            second = await _ask(second_worker, router, prefix + " second question")
    finally:
        await admin(router, "POST", f"/admin/engines/{favourite}/readmit")
    assert second["producer"] == holder
    assert second["predicted_cached_chars"] == BLOCKS * 256
    assert second["cached_tokens"] >= BLOCKS * 64  # the producer's own cache agrees


async def test_eight_prefixes_on_four_producers_holding_two_each_are_shown_and_repeats_hit(
    router: RouterProcess,
) -> None:
    chosen: dict[str, list[str]] = {p: [] for p in PRODUCERS}
    while any(len(v) < 2 for v in chosen.values()):  # prefixes that rank spreads two per producer
        prefix = _prefix(uuid.uuid4().hex)
        if len(chosen[_favourites(prefix)[0]]) < 2:
            chosen[_favourites(prefix)[0]].append(prefix)
    start = {p: (await _holdings(router, p))["blocks"] for p in PRODUCERS}
    before = _predictions(router)
    async with aiohttp.ClientSession() as session:
        for producer, prefixes in chosen.items():
            for prefix in prefixes:
                line = await _ask(session, router, prefix + " who are you?")
                assert line["producer"] == producer, line
        for producer in PRODUCERS:
            cap = (await _holdings(router, producer))["capacity_blocks"] or 10**9
            await _wait_blocks(router, producer, lambda n, p=producer, c=cap: n == min(start[p] + 2 * BLOCKS, c),
                               "two prefixes' blocks")
        for producer, prefixes in chosen.items():
            for prefix in prefixes:
                line = await _ask(session, router, prefix + " and what do you do?")
                assert line["producer"] == producer, line
                assert line["predicted_cached_chars"] == BLOCKS * 256 and line["cached_tokens"] >= BLOCKS * 64, line
    # Every repeat exact; a first prefill is judged too once its producer has reported cached tokens.
    delta = _delta(router, before, {"exact": 16, "over": 0, "under": 0})
    assert delta["over"] == delta["under"] == 0 and 8 <= delta["exact"] <= 16, delta


async def test_after_the_producer_evicts_the_next_prefill_is_over_and_lowers_its_holdings(
    fresh: tuple[RouterProcess, FakeFleet],
) -> None:
    router, hfleet = fresh
    async with aiohttp.ClientSession() as session:
        prefix = _prefix(uuid.uuid4().hex)
        holder = (await _ask(session, router, prefix + " one"))["producer"]
        # A hit, so the holder has reported cached tokens: from then on a prefill that reports
        # none is judged as nothing cached (before, an absent field may mean an older vLLM).
        await _wait_blocks(router, holder, lambda n: n >= BLOCKS, "the prefix published")
        assert (await _ask(session, router, prefix + " again"))["cached_tokens"] >= BLOCKS * 64
        other = _prefix(uuid.uuid4().hex)
        while _favourites(other)[0] != holder:
            other = _prefix(uuid.uuid4().hex)
        assert (await _ask(session, router, other + " two"))["producer"] == holder
        await _wait_blocks(router, holder, lambda n: n >= 2 * BLOCKS, "both prefixes published")
        hfleet.set_model(holder, prefix_cache=False)  # the engine's cache emptied behind the router's back
        hfleet.set_model(holder, prefix_cache=True)
        before = _predictions(router)
        line = await _ask(session, router, other + " three")
        assert (line["producer"], line["predicted_cached_chars"], line["cached_tokens"] or 0) == (
            holder, BLOCKS * 256, 0)  # nothing hit: vLLM leaves the details out
        assert _delta(router, before, {"exact": 0, "over": 1, "under": 0}) == {"exact": 0, "over": 1, "under": 0}
        # Its first block was gone, so was everything used before it (the other prefix): only
        # what this prefill put back is believed held.
        await _wait_blocks(router, holder, lambda n: n == BLOCKS, "the evicted prefix forgotten")
        line = await _ask(session, router, prefix + " four")
        assert line["predicted_cached_chars"] == 0 and not line["cached_tokens"]


async def test_a_restarted_producer_loses_its_holdings(router: RouterProcess, hfleet: FakeFleet) -> None:
    async with aiohttp.ClientSession() as session:
        prefix = _prefix(uuid.uuid4().hex)
        holder = (await _ask(session, router, prefix + " one"))["producer"]
        await _wait_blocks(router, holder, lambda n: n >= BLOCKS, "published")
        hfleet.control_request("POST", f"/engines/{holder}/stop")
        hfleet.control_request("POST", f"/engines/{holder}/start?restart=1")  # a new engine id, an empty cache
        before = _predictions(router)
        line = await _ask(session, router, prefix + " two")
        assert (line["producer"], line["predicted_cached_chars"], line["cached_tokens"] or 0) == (
            holder, BLOCKS * 256, 0)  # nothing hit: vLLM leaves the details out
        # The new engine id drops everything the old engine held: not an eviction to learn from.
        assert _delta(router, before, {"exact": 1, "over": 0, "under": 0}) == {"exact": 1, "over": 0, "under": 0}
        await _wait_blocks(router, holder, lambda n: n == BLOCKS, "only what the new engine computed")


async def test_a_restarted_supervisor_keeps_the_holdings(
    hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    proc = _router(hfleet, tmp_path_factory.mktemp("restart"), workers=1)
    try:
        async with aiohttp.ClientSession() as session:
            prefix = _prefix(uuid.uuid4().hex)
            holder = (await _ask(session, proc, prefix + " one"))["producer"]
            await _wait_blocks(proc, holder, lambda n: n == BLOCKS, "published")
            (old,) = router_roles(proc.proc.pid)["supervisor"]
            os.kill(old, signal.SIGKILL)
            wait_until(lambda: [p for p in router_roles(proc.proc.pid)["supervisor"] if p != old], 15,
                       "a new supervisor")
            other = _prefix(uuid.uuid4().hex)
            while _favourites(other)[0] != holder:
                other = _prefix(uuid.uuid4().hex)
            assert (await _ask(session, proc, other + " two"))["producer"] == holder
            # The new supervisor started from the published section: both prefixes, not only the new one.
            await _wait_blocks(proc, holder, lambda n: n == 2 * BLOCKS, "both prefixes")
            line = await _ask(session, proc, prefix + " three")
            assert (line["producer"], line["predicted_cached_chars"]) == (holder, BLOCKS * 256)
    finally:
        proc.stop()


async def test_capacity_is_read_from_cache_config_info(router: RouterProcess, hfleet: FakeFleet) -> None:
    name = PRODUCERS[0]

    def capacity(held: dict[str, Any], kv_blocks: int) -> int:
        return int(kv_blocks * 16 * (held.get("chars_per_token") or 4.0)) // 256

    async def until_capacity(kv_blocks: int) -> dict[str, Any]:
        end = asyncio.get_running_loop().time() + 10
        while True:
            held = await _holdings(router, name)
            if held["capacity_blocks"] == capacity(held, kv_blocks) or asyncio.get_running_loop().time() > end:
                return held
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession() as session:
        prefix = _prefix(uuid.uuid4().hex)
        while _favourites(prefix)[0] != name:
            prefix = _prefix(uuid.uuid4().hex)
        await _ask(session, router, prefix + " q")
    held = await until_capacity(KV_BLOCKS)
    assert held["capacity_blocks"] == capacity(held, KV_BLOCKS)
    try:
        hfleet.set_model(name, kv_blocks=40)  # smaller than one prefix: the holdings shrink to it
        held = await until_capacity(40)
        assert held["capacity_blocks"] == capacity(held, 40) and held["blocks"] <= held["capacity_blocks"]
    finally:
        hfleet.set_model(name, kv_blocks=KV_BLOCKS)


async def test_a_second_replica_learns_what_the_first_placed_from_cached_tokens(
    fresh: tuple[RouterProcess, FakeFleet], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    router, hfleet = fresh
    replica = _router(hfleet, tmp_path_factory.mktemp("replica"), workers=1)
    try:
        prefix = _prefix(uuid.uuid4().hex)
        async with aiohttp.ClientSession() as session:
            holder = (await _ask(session, router, prefix + " one"))["producer"]
            before = _predictions(replica)
            # Knowing nothing, the replica agrees by rank; the producer's answer says it held it.
            line = await _ask(session, replica, prefix + " two")
        assert (line["producer"], line["predicted_cached_chars"]) == (holder, 0)
        assert line["cached_tokens"] >= BLOCKS * 64
        assert _delta(replica, before, {"exact": 0, "over": 0, "under": 1}) == {"exact": 0, "over": 0, "under": 1}
        await _wait_blocks(replica, holder, lambda n: n >= BLOCKS, "learned from the answer")
    finally:
        replica.stop()


@pytest.mark.parametrize(("placement", "first", "second"), [
    ({"policy": "held"}, "rendezvous", "held"),
    ({"policy": "affinity"}, "affinity", "affinity"),
    ({"policy": "least_loaded"}, "least_loaded", "least_loaded"),
    ({"policy": "held", "prefix_affinity": False}, "least_loaded", "least_loaded"),
])
async def test_each_policy_setting_labels_its_choices(
    hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory, placement: dict[str, Any], first: str, second: str,
) -> None:
    proc = _router(hfleet, tmp_path_factory.mktemp("policy"), workers=1, **placement)
    try:
        prefix = _prefix(uuid.uuid4().hex)
        async with aiohttp.ClientSession() as session:
            lines = [await _ask(session, proc, prefix + " one")]
            if first == "rendezvous":
                await _wait_blocks(proc, lines[0]["producer"], lambda n: n >= BLOCKS, "published")
            lines.append(await _ask(session, proc, prefix + " two"))

        def choices() -> dict[str, float]:
            text = scrape(proc)
            return {c: value(text, "narwhal_placements_total", producer_choice=c)
                    for c in {first, second} if value(text, "narwhal_placements_total", producer_choice=c)}

        expected = {first: 1.0, second: 1.0} if first != second else {first: 2.0}
        assert settled(choices, expected) == expected
        held = first == "rendezvous"
        assert [line["predicted_cached_chars"] for line in lines] == ([0, BLOCKS * 256] if held else [None, None])
    finally:
        proc.stop()


async def test_a_slower_producer_gets_fewer_new_prefixes_once_its_rate_is_learned(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two producers, one prefilling 4× slower (as an older GPU): once each has prefilled with
    nothing queued ahead, a prefix nobody holds goes to the fast one even where rank prefers the
    slow one (4× the estimate is beyond the slack)."""
    names = ["rslow", "rfast", "rd0"]
    fleet = FakeFleet.start(names, args=["--model", MODEL, "--prefix-cache", "--prefill-us-per-token", "10",
                                         "--prefill-us-per-token", "rslow=40"])
    engines = [{"name": "rslow", "role": "producer"}, {"name": "rfast", "role": "producer"},
               {"name": "rd0", "role": "consumer"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("slow"), server={"workers": 1, "admin_token": TOKEN},
                        placement={"load_interval_s": 0.1, "affinity_slack": 0.5})
    try:
        def ranked_first(name: str) -> str:
            while True:
                prefix = _prefix(uuid.uuid4().hex)
                if rank(["rslow", "rfast"], PrefixBlocks(prefix, 256, 65536).key(0), key_hash)[0] == name:
                    return prefix

        async with aiohttp.ClientSession() as session:
            for name in ("rslow", "rfast"):  # one clean prefill each: both rates learned
                assert (await _ask(session, proc, ranked_first(name) + " q"))["producer"] == name
            for name in ("rslow", "rfast"):
                await _wait_rate(proc, name)
            rates = {n: (await engine_entry(proc, n))["holdings"]["prefill_chars_per_s"] for n in ("rslow", "rfast")}
            assert rates["rfast"] > 2 * rates["rslow"], rates
            chosen = [(await _ask(session, proc, ranked_first("rslow") + " q"))["producer"] for _ in range(4)]
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


async def test_a_full_table_forgets_the_oldest_keys_without_an_error(
    hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # 40 slots for 4 producers: 10 keys each, fewer than one prefix's 15 blocks.
    proc = _router(hfleet, tmp_path_factory.mktemp("slots"), workers=1, holdings_slots=40)
    try:
        async with aiohttp.ClientSession() as session:
            prefix = _prefix(uuid.uuid4().hex)
            holder = (await _ask(session, proc, prefix + " one"))["producer"]
            await _wait_blocks(proc, holder, lambda n: n == 10, "cut to the room")
            # The prompt's tail went first (as vLLM evicts it): its head is still believed held.
            line = await _ask(session, proc, prefix + " two")
            assert (line["producer"], line["predicted_cached_chars"]) == (holder, 10 * 256)
    finally:
        proc.stop()
