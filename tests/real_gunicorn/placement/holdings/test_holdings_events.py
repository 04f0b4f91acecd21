"""The engines' KV-cache events (docs/behaviour.md "Placement"), through real gunicorn: two
routers over one fleet of fakes that publish as vLLM does each follow every engine's events
(their own subscriptions: nothing shared but what the engines publish), show it in
``/admin/engines`` (``holdings.source``), place a prompt where the events say its blocks are
(both replicas alike, whatever traffic each saw), predict the cached tokens the engine then
reports, and drop a producer's holdings at once when its events say it restarted, without any
traffic of their own to it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.supervisor.holdings import PUBLISH_S
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.placement.holdings import holdings_support as hs
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    access_line,
    completion,
    engine_entry,
    records,
    scrape,
    send,
    start_router,
    value,
    wait_until,
)


@pytest.fixture(scope="module")
def efleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(hs.PRODUCERS + hs.CONSUMERS, args=[
        "--model", MODEL, "--lease-s", "120", "--kv-events", "--kv-blocks", str(hs.KV_BLOCKS),
        "--prefill-us-per-token", "10"])
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def two(efleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    # Consumers hold what they decoded: these tests are about producers, so none decodes alone here.
    first = hs.start(efleet, tmp_path_factory.mktemp("first"), skip_prefill_share=0)
    second = hs.start(efleet, tmp_path_factory.mktemp("second"), skip_prefill_share=0)
    try:
        yield first, second
    finally:
        first.stop()
        second.stop()


async def _sources(router: RouterProcess) -> dict[str, str | None]:
    return {name: ((await engine_entry(router, name))["holdings"] or {}).get("source")
            for name in hs.PRODUCERS + hs.CONSUMERS}


async def test_each_replica_follows_every_engines_events_and_drops_a_restarted_ones_holdings(
    two: tuple[RouterProcess, RouterProcess], efleet: FakeFleet
) -> None:
    first, second = two
    prefix = hs.make_prefix()
    # Traffic through the first router only: the second learns nothing from it but the events.
    for i in range(len(hs.PRODUCERS) * 2):
        reply = await send(first.url, "/v1/completions", completion(f"{prefix} q{i}", max_tokens=2, stream=False))
        assert reply.status == 200, reply.raw
    for router in two:
        # A publisher is followed once it has sent a batch in order: each engine that prefilled.
        wait_until(lambda r=router: sum(value(scrape(r), "narwhal_kv_events_total", engine=n, verdict="applied")
                                        for n in hs.PRODUCERS) >= 1, 10, "events applied")
    holder = next(n for n in hs.PRODUCERS
                  if value(scrape(first), "narwhal_kv_events_total", engine=n, verdict="applied") >= 1)
    for router in two:
        assert (await _sources(router))[holder] == "events"
    held = await hs.wait_blocks(first, holder, lambda blocks: blocks > 0, "the first router learned its blocks")
    assert held["source"] == "events"

    before = [value(scrape(r), "narwhal_kv_event_resets_total", engine=holder) for r in two]
    efleet.control_request("POST", f"/engines/{holder}/start?restart=1")  # a new process: its cache empty
    # Its next batch (sequence 0 again) shows the restart to both replicas: a prefill sent to the
    # engine directly, so neither router's traffic has anything to do with it.
    async with aiohttp.ClientSession() as session, session.post(
            efleet.engines[holder] + "/v1/completions",
            json={"model": MODEL, "prompt": hs.make_prefix(), "max_tokens": 1}) as resp:
        assert resp.status == 200
    for router, was in zip(two, before, strict=True):
        wait_until(lambda r=router, w=was: value(scrape(r), "narwhal_kv_event_resets_total", engine=holder) == w + 1,
                   10, "the restart seen")
    await hs.wait_blocks(first, holder, lambda blocks: blocks == 0, "its learned holdings dropped")
    assert f"engine {holder}: its KV-cache holdings dropped: its sequence started again" in first.log_text()


async def _placed(router: RouterProcess, prompt: str) -> dict[str, Any]:
    rid = f"events-{uuid.uuid4().hex}"
    reply = await send(router.url, "/v1/completions", completion(prompt, max_tokens=2, stream=False),
                       headers={"x-request-id": rid})
    assert reply.status == 200, reply.raw
    return access_line(router, rid)


async def test_both_replicas_place_a_prompt_where_the_events_say_it_is_and_predict_its_cached_tokens(
    two: tuple[RouterProcess, RouterProcess], efleet: FakeFleet
) -> None:
    """A prompt prefilled on the producer its rank puts last, by another client straight to the
    engine (neither router saw it): each router sends it there, as ``held``, predicting exactly
    the cached tokens the engine reports; after that producer restarts, neither counts on it."""
    first, second = two
    prompt = hs.make_prefix() + " the user's question"
    holder = hs.favourites(prompt)[-1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    heard = [_batches(router, holder) for router in two]
    async with aiohttp.ClientSession() as session, session.post(efleet.engines[holder] + "/v1/completions",
                                                                json=body) as resp:
        assert resp.status == 200
    for router, was in zip(two, heard, strict=True):
        await _published(router, holder, was)
    for router in (second, first):
        line = await _placed(router, prompt)
        assert (line["producer"], line["predicted_cached_tokens"]) == (holder, line["cached_tokens"]), line
        assert line["cached_tokens"] > 0 and line["predicted_cached_chars"] > 0
    assert value(scrape(first), "narwhal_prompt_token_ids_total", source="tokenize") >= 1

    before = [value(scrape(r), "narwhal_kv_event_resets_total", engine=holder) for r in two]
    efleet.control_request("POST", f"/engines/{holder}/start?restart=1")  # its cache empty, its sequence at 0
    async with aiohttp.ClientSession() as session, session.post(
            efleet.engines[holder] + "/v1/completions",
            json={"model": MODEL, "prompt": hs.make_prefix(), "max_tokens": 1}) as resp:
        assert resp.status == 200  # another prompt: its first batch shows the restart
    for router, was in zip(two, before, strict=True):
        wait_until(lambda r=router, w=was: value(scrape(r), "narwhal_kv_event_resets_total", engine=holder) > w,
                   10, "the restart seen")
    heard = {name: _batches(second, name) for name in hs.PRODUCERS}
    line = await _placed(first, prompt)
    # Nobody holds it now: nothing predicted (None: a producer that never published is not followed yet), nothing
    # cached (vLLM leaves prompt_tokens_details out of a prefill that hit nothing).
    assert not line["predicted_cached_tokens"] and not line["cached_tokens"], str(line)
    now = line["producer"]  # where the first replica put it: the second follows once the events say so
    await _published(second, now, heard[now])
    again = await _placed(second, prompt)
    assert (again["producer"], again["predicted_cached_tokens"]) == (now, again["cached_tokens"]), again
    assert again["cached_tokens"] > 0


async def test_a_follow_up_turn_is_decoded_alone_by_the_consumer_that_holds_its_prompt(
    efleet: FakeFleet, tmp_path: Any
) -> None:
    """Turn 1 goes P/D; the consumer that decoded it caches its prompt (as vLLM does once the KV
    arrives) and publishes it; turn 2, that prompt and a short follow-up, is decoded there alone
    (``placement.skip_prefill_share``, 0.9 by default): no producer prefills it."""
    router = hs.start(efleet, tmp_path, skip_prefill_share=0.9)  # the default
    try:
        messages = [{"role": "system", "content": hs.make_prefix()}, {"role": "user", "content": "first question"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": False}
        heard = {name: _batches(router, name) for name in hs.CONSUMERS}
        line = await hs.chat_turn(router, body, "turn1")
        assert line["mode"] == "disaggregated" and line["producer"] in hs.PRODUCERS, line
        consumer = line["consumer"]
        await _published(router, consumer, heard[consumer])
        follow = messages + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
        prefills = hs.prefills(efleet)
        line = await hs.chat_turn(router, {**body, "messages": follow}, "turn2")
        assert (line["mode"], line["consumer"], line["producer"]) == ("local", consumer, None), line
        assert hs.prefills(efleet) == prefills  # none prefilled
        wait_until(lambda: value(scrape(router), "narwhal_placements_total", producer_choice="consumer_holds") == 1,
                   5, "the placement counted")
    finally:
        router.stop()


async def test_a_follow_up_carrying_a_long_answer_is_held_by_the_consumer_that_wrote_it(
    efleet: FakeFleet, tmp_path: Any
) -> None:
    """The consumer caches the blocks its decode filled too, as vLLM does, and publishes them: a
    follow-up whose prompt is mostly turn 1's answer (a short question, a 300-token answer) is
    held past ``skip_prefill_share`` only by those blocks, and is decoded there alone."""
    router = hs.start(efleet, tmp_path, skip_prefill_share=0.9)  # the default
    try:
        messages = [{"role": "user", "content": hs.make_prefix()[:600]}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 300, "stream": True, "ignore_eos": True}
        turn1 = f"turn1-{uuid.uuid4().hex}"
        heard = {name: _batches(router, name) for name in hs.CONSUMERS}
        reply = await send(router.url, "/v1/chat/completions", body, headers={"x-request-id": turn1})
        assert reply.status == 200, reply.raw
        answer = "".join((orjson.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                         for e in reply.events[:-1])
        assert len(answer) > 4 * len(messages[0]["content"]) // 2, answer[:80]  # most of turn 2 is the answer
        line = access_line(router, turn1)
        assert line["mode"] == "disaggregated", line
        consumer = line["consumer"]
        await _published(router, consumer, heard[consumer])
        follow = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "why?"}]
        turn2 = f"turn2-{uuid.uuid4().hex}"
        reply = await send(router.url, "/v1/chat/completions", {**body, "messages": follow, "max_tokens": 2},
                           headers={"x-request-id": turn2})
        assert reply.status == 200, reply.raw
        line = access_line(router, turn2)
        assert (line["mode"], line["consumer"], line["producer"]) == ("local", consumer, None), line
    finally:
        router.stop()


async def test_a_router_that_subscribes_late_learns_a_reused_prefix_from_the_full_report(tmp_path: Any) -> None:
    """A prefix cached before the router subscribed, its batch gone from a one-batch replay buffer:
    nothing the router hears says the producer holds it, and a cache hit publishes nothing. For
    a while after subscribing, the router's prefills ask for the full report
    (``vllm_xargs.kv_cache_report_mode``): the first one that reuses the prefix has the producer
    re-announce it, and the next is placed by it, predicting the cached tokens exactly."""
    fleet = FakeFleet.start(["lp0", "lp1", "ld0"], args=["--model", MODEL, "--lease-s", "60", "--kv-events",
                                                         "--kv-buffer-steps", "1"])
    try:
        prompt = hs.make_prefix() + " the question"
        holder = rank(["lp0", "lp1"], PrefixBlocks(prompt, 256, 65536).key(0), key_hash)[0]  # where rank sends it
        async with aiohttp.ClientSession() as session:
            for text in (prompt, hs.make_prefix()):  # cached, then rolled out of the replay buffer
                async with session.post(fleet.engines[holder] + "/v1/completions",
                                        json={"model": MODEL, "prompt": text, "max_tokens": 1}) as resp:
                    assert resp.status == 200
        engines = [{"name": "lp0", "role": "producer"}, {"name": "lp1", "role": "producer"},
                   {"name": "ld0", "role": "consumer"}]
        router = start_router(fleet, engines, tmp_path, server={"workers": 1, "admin_token": TOKEN},
                              placement={"load_interval_s": 0.1, "skip_prefill_share": 0,
                                         "held": {"affinity_slack": hs.SLACK}})
        try:
            end = asyncio.get_running_loop().time() + 10
            while not (await hs.holdings(router, holder)).get("full_report"):  # subscribed, and said so
                assert asyncio.get_running_loop().time() < end, await hs.holdings(router, holder)
                await asyncio.sleep(0.05)
            first = await _placed(router, prompt)
            assert first["producer"] == holder and first["cached_tokens"], first  # a hit the router did not foresee
            (prefill,) = [r for r in records(fleet, holder, prompt) if r["phase"] == "prefill"][-1:]
            assert prefill["body"].get("vllm_xargs") == {"kv_cache_report_mode": "full"}, prefill["body"]
            await _wait_event_blocks(router, holder, above=0)
            again = await _placed(router, prompt + " again")
            assert again["producer"] == holder and again["predicted_cached_tokens"] == again["cached_tokens"] > 0, again
        finally:
            router.stop()
    finally:
        fleet.stop()


def _batches(router: RouterProcess, name: str) -> float:
    """The KV-event batches ``router`` heard from ``name``, whatever it made of them."""
    text = scrape(router)
    return sum(value(text, "narwhal_kv_events_total", engine=name, verdict=v)
               for v in ("applied", "gap", "restart", "duplicate"))


async def _published(router: RouterProcess, name: str, heard: float) -> None:
    """Until ``router`` heard a batch from ``name`` beyond ``heard``, then one publish of the
    supervisor's holdings (at most every ``supervisor.holdings.PUBLISH_S``, 0.1 s, on a 20 ms loop)."""
    wait_until(lambda: _batches(router, name) > heard, 10, f"a KV-event batch of {name} heard")
    await asyncio.sleep(3 * PUBLISH_S)


async def _event_blocks(router: RouterProcess, name: str) -> int:
    return (await hs.holdings(router, name)).get("event_blocks") or 0


async def _wait_event_blocks(router: RouterProcess, name: str, above: int, timeout: float = 10) -> None:
    """Until ``name``'s holdings in ``router`` show more than ``above`` blocks from its events (bounded)."""
    end = asyncio.get_running_loop().time() + timeout
    while await _event_blocks(router, name) <= above:
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"{name}: no new event blocks in {router.url}'s holdings")
        await asyncio.sleep(0.05)
