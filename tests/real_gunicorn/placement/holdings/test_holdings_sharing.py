"""docs/behaviour.md "Placement" through real gunicorn, what is shared: holdings every worker reads, what a second
replica learns from cached tokens, and each policy setting's labels (``holdings_support`` says
what the fleet is)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from narwhal.engines.dialects.openai import Chat
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.placement.holdings import holdings_support as hs
from tests.real_gunicorn.placement.holdings.holdings_support import BLOCKS, PRODUCERS
from tests.real_gunicorn.support import (
    access_line,
    admin,
    engine_entry,
    scrape,
    sessions_per_worker,
    settled,
    value,
    wait_state,
)


async def test_a_prefix_prefilled_through_one_worker_is_placed_on_its_producer_by_the_other(
    router: RouterProcess,
) -> None:
    prefix = hs.make_prefix()
    favourite = hs.favourites(prefix)[0]
    # The favourite out while the first worker places the prefix: it goes to the second in rank.
    await admin(router, "POST", f"/admin/engines/{favourite}/eject")
    try:
        async with sessions_per_worker(router, 2) as sessions:
            first_worker, second_worker = sessions.values()
            first = await hs.ask(first_worker, router, prefix + " first question")
            holder = first["producer"]
            assert holder == hs.favourites(prefix)[1] and first["predicted_cached_chars"] == 0
            await admin(router, "POST", f"/admin/engines/{favourite}/readmit")
            await wait_state(router, favourite, "admitted")
            await hs.wait_blocks(router, holder, lambda n: n >= BLOCKS, "the first prefill's blocks published")
            # Rank alone would now send it to the favourite; the holdings send it where it is.
            second = await hs.ask(second_worker, router, prefix + " second question")
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
        prefix = hs.make_prefix()
        if len(chosen[hs.favourites(prefix)[0]]) < 2:
            chosen[hs.favourites(prefix)[0]].append(prefix)
    start = {p: (await hs.holdings(router, p))["blocks"] for p in PRODUCERS}
    before = hs.predictions(router)
    async with aiohttp.ClientSession() as session:
        for producer, prefixes in chosen.items():
            for prefix in prefixes:
                line = await hs.ask(session, router, prefix + " who are you?")
                assert line["producer"] == producer, line
        for producer in PRODUCERS:
            cap = (await hs.holdings(router, producer))["capacity_blocks"] or 10**9
            await hs.wait_blocks(router, producer, lambda n, p=producer, c=cap: n == min(start[p] + 2 * BLOCKS, c),
                               "two prefixes' blocks")
        for producer, prefixes in chosen.items():
            for prefix in prefixes:
                line = await hs.ask(session, router, prefix + " and what do you do?")
                assert line["producer"] == producer, line
                assert line["predicted_cached_chars"] == BLOCKS * 256 and line["cached_tokens"] >= BLOCKS * 64, line
    # Every repeat exact; a first prefill is judged too once its producer has reported cached tokens.
    delta = hs.delta(router, before, {"exact": 16, "over": 0, "under": 0})
    assert delta["over"] == delta["under"] == 0 and 8 <= delta["exact"] <= 16, delta


async def test_a_second_replica_learns_what_the_first_placed_from_cached_tokens(
    fresh: tuple[RouterProcess, FakeFleet], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    router, hfleet = fresh
    replica = hs.start(hfleet, tmp_path_factory.mktemp("replica"), workers=1)
    try:
        prefix = hs.make_prefix()
        async with aiohttp.ClientSession() as session:
            holder = (await hs.ask(session, router, prefix + " one"))["producer"]
            before = hs.predictions(replica)
            # Knowing nothing, the replica agrees by rank; the producer's answer says it held it.
            line = await hs.ask(session, replica, prefix + " two")
        assert (line["producer"], line["predicted_cached_chars"]) == (holder, 0)
        assert line["cached_tokens"] >= BLOCKS * 64
        assert hs.delta(replica, before, {"exact": 0, "over": 0, "under": 1}) == {"exact": 0, "over": 0, "under": 1}
        await hs.wait_blocks(replica, holder, lambda n: n >= BLOCKS, "learned from the answer")
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
    proc = hs.start(hfleet, tmp_path_factory.mktemp("policy"), workers=1, **placement)
    try:
        prefix = hs.make_prefix()
        async with aiohttp.ClientSession() as session:
            lines = [await hs.ask(session, proc, prefix + " one")]
            if first == "rendezvous":
                await hs.wait_blocks(proc, lines[0]["producer"], lambda n: n >= BLOCKS, "published")
            lines.append(await hs.ask(session, proc, prefix + " two"))

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


async def test_a_follow_up_goes_to_the_consumer_that_decoded_its_prompt_without_any_events(
    hfleet: FakeFleet, tmp_path: Any
) -> None:
    # docs/behaviour.md "Placement": with no KV-cache events (these fakes publish none), what a
    # consumer holds is learned from the prompts it decoded, as a producer's holdings are; a
    # follow-up whose prompt it holds past skip_prefill_share is decoded there alone.
    router = hs.start(hfleet, tmp_path, skip_prefill_share=0.9)
    try:
        messages = [{"role": "system", "content": hs.make_prefix()}, {"role": "user", "content": "first question"}]
        body = {"model": hs.MODEL, "messages": messages, "max_tokens": 4}
        line = await hs.chat_turn(router, body, "turn1")
        assert line["mode"] == "disaggregated", line
        consumer = line["consumer"]
        await hs.wait_blocks(router, consumer, lambda blocks: blocks > 0, "its decode learned and published")
        prefills = hs.prefills(hfleet)
        follow = messages + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
        line = await hs.chat_turn(router, {**body, "messages": follow}, "turn2")
        assert (line["mode"], line["consumer"], line["producer"]) == ("local", consumer, None), line
        assert hs.prefills(hfleet) == prefills
    finally:
        router.stop()


def _blocks(messages: list[dict[str, Any]]) -> int:
    """The full blocks of a chat's affinity text (256 characters each, as the router keys them)."""
    return PrefixBlocks(Chat().affinity_text({"messages": messages}, 65536) or "", 256, 65536).count


async def test_a_conversation_with_long_answers_follows_its_consumer_by_what_it_wrote_too(
    hfleet: FakeFleet, tmp_path: Any
) -> None:
    # docs/behaviour.md "Placement": without KV-cache events a consumer's holdings are learned from
    # the prompts it decoded, and the one that decoded a turn holds the answer it wrote right after
    # that prompt, which the next turn sends back: a conversation whose answers are long against
    # its history still skips the prefill (streamed or whole), and a turn decoded there alone is
    # learned too. The openai SDK is the client, as in a chat application.
    router = hs.start(hfleet, tmp_path, skip_prefill_share=0.9)
    client = AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    try:
        messages: list[dict[str, Any]] = [{"role": "system", "content": hs.make_prefix()},
                                          {"role": "user", "content": "first question"}]
        rid = f"turn1-{uuid.uuid4().hex}"
        stream = await client.chat.completions.create(model=hs.MODEL, messages=messages, max_tokens=200,  # type: ignore[arg-type]
                                                      stream=True, extra_headers={"x-request-id": rid})
        answer = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        line = access_line(router, rid)
        assert line["mode"] == "disaggregated", line
        consumer = line["consumer"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        # The test means something: the first prompt alone is under the share of this one.
        assert _blocks(messages[:2]) / _blocks(messages) < 0.9, (len(answer), _blocks(messages))
        learned = await hs.wait_blocks(router, consumer, lambda blocks: blocks >= _blocks(messages[:2]),
                                       "its decode learned and published")
        prefills = hs.prefills(hfleet)
        rid = f"turn2-{uuid.uuid4().hex}"
        reply = await client.chat.completions.create(model=hs.MODEL, messages=messages, max_tokens=200,  # type: ignore[arg-type]
                                                     extra_headers={"x-request-id": rid})
        line = access_line(router, rid)
        assert (line["mode"], line["consumer"], line["producer"]) == ("local", consumer, None), (line, learned)
        second = reply.choices[0].message.content or ""
        assert len(second) > 800, second
        messages += [{"role": "assistant", "content": second}, {"role": "user", "content": "and after that?"}]
        assert _blocks(messages[:4]) / _blocks(messages) < 0.9
        await hs.wait_blocks(router, consumer, lambda blocks: blocks >= _blocks(messages[:4]),
                             "the turn it decoded alone learned")
        rid = f"turn3-{uuid.uuid4().hex}"
        await client.chat.completions.create(model=hs.MODEL, messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                             extra_headers={"x-request-id": rid})
        line = access_line(router, rid)
        assert (line["mode"], line["consumer"]) == ("local", consumer), line
        assert hs.prefills(hfleet) == prefills  # neither follow-up cost a producer a prefill
    finally:
        await client.close()
        router.stop()


async def test_a_consumer_that_restarts_has_what_it_learned_forgotten_once_it_answers(
    hfleet: FakeFleet, tmp_path: Any
) -> None:
    # docs/behaviour.md "Placement": a restarted consumer's cache is empty and nothing it sends says
    # so; an engine that answers again after refusing connections starts from nothing learned, so
    # the follow-up it no longer holds goes P/D instead of being computed whole on it.
    router = hs.start(hfleet, tmp_path, skip_prefill_share=0.9)
    messages = [{"role": "system", "content": hs.make_prefix()}, {"role": "user", "content": "first question"}]
    body = {"model": hs.MODEL, "messages": messages, "max_tokens": 4}
    stopped = ""  # the consumer while it is stopped: the module's fleet gets it back whatever happens
    try:
        consumer = (await hs.chat_turn(router, body, "turn1"))["consumer"]
        await hs.wait_blocks(router, consumer, lambda blocks: blocks > 0, "its decode learned and published")
        hfleet.control_request("POST", f"/engines/{consumer}/stop")
        stopped = consumer
        for _ in range(100):  # the supervisor's control reads find it refusing connections
            if (await engine_entry(router, consumer))["unreachable"]:
                break
            await asyncio.sleep(0.1)
        assert (await engine_entry(router, consumer))["unreachable"]
        hfleet.control_request("POST", f"/engines/{consumer}/start?restart=1")
        stopped = ""
        await hs.wait_blocks(router, consumer, lambda blocks: blocks == 0, "forgotten once it answered again")
        follow = messages + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
        line = await hs.chat_turn(router, {**body, "messages": follow}, "turn2")
        assert line["mode"] == "disaggregated", line
    finally:
        router.stop()
        if stopped:
            hfleet.control_request("POST", f"/engines/{stopped}/start?restart=1")
