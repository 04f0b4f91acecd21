"""docs/behaviour.md "Placement" through real gunicorn: engine-reported load, prefix affinity, local decode, cached
tokens.

Its own fleet (the fake's prefix cache on, which the session fleet must not have) and one
router with 2 workers reading the engines' ``/metrics`` every 100 ms. Prompts of 40 to 63
characters are placed by load alone (no affinity key, not local); shorter ones are decoded
locally; longer ones have a key.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    access_line,
    admin,
    at_rest,
    completion,
    engine_entry,
    expected_text,
    post,
    scrape,
    send,
    sessions_per_worker,
    settled,
    start_router,
    value,
    wait_until,
)

PRODUCERS = ["ap0", "ap1"]
CONSUMERS = ["ad0", "ad1"]
LOCAL_CHARS = 40


def _engines(producers: list[str], consumers: list[str]) -> list[dict[str, Any]]:
    return [{"name": n, "role": "producer"} for n in producers] + [{"name": n, "role": "consumer"} for n in consumers]


@pytest.fixture(scope="module")
def cache_fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(PRODUCERS + CONSUMERS, args=["--model", MODEL, "--lease-s", "120", "--prefix-cache"])
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def router(cache_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = start_router(
        cache_fleet, _engines(PRODUCERS, CONSUMERS), tmp_path_factory.mktemp("placement"),
        server={"workers": 2, "admin_token": TOKEN},
        # "Placement"'s rules under test: the rendezvous affinity rule, not "Placement"'s default (test_holdings).
        placement={"load_interval_s": 0.1, "load_stale_s": 2, "local_prefill_chars": LOCAL_CHARS,
                   "policy": "affinity"},
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def second_router(cache_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """Another replica in front of the same fleet, sharing nothing with the first."""
    proc = start_router(cache_fleet, _engines(PRODUCERS, CONSUMERS), tmp_path_factory.mktemp("replica"),
                        server={"workers": 1}, placement={"policy": "affinity"})
    yield proc
    proc.stop()


BLIND = ["bp0", "bp1", "bd0", "bd1"]


@pytest.fixture(scope="module")
def blind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeFleet, RouterProcess]]:
    """Placement as before engines reported load (no reads, no affinity), on a fleet of its own:
    no other router reads these engines' /metrics, so every read they count would be this one's."""
    fleet = FakeFleet.start(BLIND, args=["--model", MODEL, "--prefix-cache"])
    try:
        proc = start_router(
            fleet, _engines(BLIND[:2], BLIND[2:]), tmp_path_factory.mktemp("blind"),
            server={"workers": 2, "admin_token": TOKEN}, recovery={"health_interval_s": 0.2},
            placement={"load_interval_s": 0, "policy": "least_loaded"},
        )
        yield fleet, proc
        proc.stop()
    finally:
        fleet.stop()


def _tag() -> str:
    return uuid.uuid4().hex


def _plain_prompt(tag: str) -> str:
    """Between local_prefill_chars and affinity_min_chars: placed by load, no key."""
    prompt = f"{tag} plain question w1 w2"
    assert LOCAL_CHARS <= len(prompt) < 64
    return prompt


def _records(fleet: FakeFleet, engine: str, tag: str) -> list[dict[str, Any]]:
    return list(fleet.control_request("GET", f"/engines/{engine}/requests?contains={tag}")["requests"])


async def _wait_load(router: RouterProcess, name: str, check: Any, what: str, timeout: float = 15) -> dict:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        load = (await engine_entry(router, name))["load"]
        if check(load):
            return dict(load) if load is not None else {}
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"{name}: {what}; last load {load}")
        await asyncio.sleep(0.05)


def _fresh(load: dict | None) -> bool:
    return load is not None and load["age_s"] < 2


async def test_same_prefix_requests_from_two_workers_reach_one_producer(
    cache_fleet: FakeFleet, router: RouterProcess
) -> None:
    tag = _tag()
    # A system prompt longer than affinity_chars (1024): the key is the same whatever follows.
    prefix = f"{tag} " + "You are the assistant of the affinity test; answer briefly. " * 20
    before = at_rest(router, "narwhal_placements_total")
    async with sessions_per_worker(router, 2) as sessions:
        for i in range(6):
            for session in sessions.values():
                status, body = await post(session, router, completion(prefix + f"question {i}", stream=False))
                assert status == 200, body
    served = {p: len(_records(cache_fleet, p, tag)) for p in PRODUCERS}
    assert sorted(served.values()) == [0, 12], served  # every prefill on one producer, from both workers

    def affinity_delta() -> float:
        return value(scrape(router), "narwhal_placements_total", producer_choice="affinity") - value(
            before, "narwhal_placements_total", producer_choice="affinity")

    assert settled(affinity_delta, 12.0) == 12.0


async def test_two_router_replicas_send_a_prefix_to_the_same_producer(
    cache_fleet: FakeFleet, router: RouterProcess, second_router: RouterProcess
) -> None:
    for n in range(4):
        tag = _tag()
        prompt = f"{tag} " + f"system prompt {n} shared by every replica's users. " * 25 + "question"
        chosen = []
        for replica in (router, second_router):
            reply = await send(replica.url, "/v1/completions", completion(prompt, stream=False))
            assert reply.status == 200, reply.raw
            chosen.append({p for p in PRODUCERS if _records(cache_fleet, p, tag)})
        assert len(chosen[0]) == 1 and chosen[1] == chosen[0], chosen


async def test_a_consumer_busy_behind_the_routers_back_is_avoided(
    cache_fleet: FakeFleet, router: RouterProcess
) -> None:
    cache_fleet.set_background("ad0", 6, hold_s=60)
    try:
        # Requests another replica sends, which this router never saw: only ad0's /metrics shows them.
        await _wait_load(router, "ad0", lambda ld: _fresh(ld) and ld["running"] + ld["waiting"] == 6,
                         "the background load never showed")
        tag = _tag()
        for _ in range(8):
            reply = await send(router.url, "/v1/completions", completion(_plain_prompt(tag)))
            assert reply.status == 200, reply.raw
        assert (len(_records(cache_fleet, "ad0", tag)), len(_records(cache_fleet, "ad1", tag))) == (0, 8)
    finally:
        cache_fleet.set_background("ad0", 0)
    await _wait_load(router, "ad0", lambda ld: _fresh(ld) and ld["running"] + ld["waiting"] == 0,
                     "the background load never went")


def _breaker_view(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k not in ("load", "inflight")} for e in entries]


async def test_metrics_that_hang_or_lie_change_nothing_but_load(
    cache_fleet: FakeFleet, router: RouterProcess
) -> None:
    before = _breaker_view((await admin(router))["engines"])
    cache_fleet.control_request("PUT", "/engines/ad1/faults", {"metrics": "hang"})
    cache_fleet.control_request("PUT", "/engines/ap1/faults", {"metrics": "garbage"})
    try:
        for name in ("ad1", "ap1"):  # the last good reading goes stale; nothing else happens
            await _wait_load(router, name, lambda ld: ld is None or ld["age_s"] > 2, "its reading never went stale")
        tag = _tag()
        for _ in range(16):
            reply = await send(router.url, "/v1/completions", completion(_plain_prompt(tag)))
            assert reply.status == 200, reply.raw
            assert reply.text == expected_text(4)
        used = {e for e in PRODUCERS + CONSUMERS if _records(cache_fleet, e, tag)}
        assert used == set(PRODUCERS + CONSUMERS)  # both still placed, by in-flight counts and ties
        assert _breaker_view((await admin(router))["engines"]) == before
    finally:
        for name in ("ad1", "ap1"):
            cache_fleet.control_request("DELETE", f"/engines/{name}/faults")
    for name in ("ad1", "ap1"):
        await _wait_load(router, name, _fresh, "reading never came back")


async def test_a_local_decode_sends_nothing_to_any_producer(cache_fleet: FakeFleet, router: RouterProcess) -> None:
    tag = _tag()[:16]
    prompt = f"{tag} hi"
    assert len(prompt) < LOCAL_CHARS
    before = at_rest(router, "narwhal_local_decodes_total")
    rid = "local-" + tag
    reply = await send(router.url, "/v1/completions", completion(prompt), headers={"x-request-id": rid})
    assert reply.status == 200, reply.raw
    assert reply.text == expected_text(4)
    assert all(_records(cache_fleet, p, tag) == [] for p in PRODUCERS)
    decoded = [r for c in CONSUMERS for r in _records(cache_fleet, c, tag)]
    assert len(decoded) == 1
    assert "kv_transfer_params" not in decoded[0]["body"]
    assert decoded[0]["body"]["stream"] is True and decoded[0]["body"]["max_tokens"] == 4
    line = access_line(router, rid)
    assert (line["mode"], line["producer"], line["ttft_s"]) == ("local", None, None)
    assert line["consumer"] in CONSUMERS and line["prompt_tokens"] is None and line["cached_tokens"] is None

    def local_delta() -> float:
        return value(scrape(router), "narwhal_local_decodes_total") - value(before, "narwhal_local_decodes_total")

    assert settled(local_delta, 1.0) == 1.0


async def test_cached_tokens_reach_the_access_log_and_the_counter(
    cache_fleet: FakeFleet, router: RouterProcess
) -> None:
    tag = _tag()
    # Longer than affinity_chars (1024): both prompts have the same key, so the same producer.
    shared = (tag + " ") + "".join(f"block {i:02d} ".ljust(64, "x") for i in range(17))
    before = at_rest(router, "narwhal_prefill_tokens_total")
    lines = []
    for i, tail in enumerate(("first question", "other question")):
        rid = f"cached-{i}-{tag}"
        reply = await send(router.url, "/v1/completions", completion(shared + tail, stream=False),
                           headers={"x-request-id": rid})
        assert reply.status == 200, reply.raw
        lines.append(access_line(router, rid))
    first, second = lines
    assert first["mode"] == second["mode"] == "disaggregated"
    assert first["producer"] == second["producer"]
    # a miss: 0.33's descriptor says 0 hits (docs/decisions.md "vLLM releases"), usage says nothing
    assert first["cached_tokens"] == 0
    assert isinstance(second["cached_tokens"], int) and second["cached_tokens"] >= 17 * 16
    assert first["prompt_tokens"] == second["prompt_tokens"] > second["cached_tokens"]
    expected = {
        "cached": float(second["cached_tokens"]),
        "computed": float(first["prompt_tokens"] + second["prompt_tokens"] - second["cached_tokens"]),
    }

    def deltas() -> dict[str, float]:
        now = scrape(router)
        return {kind: value(now, "narwhal_prefill_tokens_total", kind=kind)
                - value(before, "narwhal_prefill_tokens_total", kind=kind) for kind in expected}

    assert settled(deltas, expected) == expected


async def test_without_load_reads_or_affinity_placement_is_in_flight_and_ties(
    blind: tuple[FakeFleet, RouterProcess]
) -> None:
    fleet, router = blind
    before = at_rest(router, "narwhal_placements_total")
    tag = _tag()
    prompt = f"{tag} " + "a long shared system prompt that affinity would pin to one producer. " * 20
    for i in range(16):
        reply = await send(router.url, "/v1/completions", completion(prompt + f"question {i}", stream=False))
        assert reply.status == 200, reply.raw
    served = {p: len(_records(fleet, p, tag)) for p in ("bp0", "bp1")}
    assert sum(served.values()) == 16 and min(served.values()) > 0, served  # ties at random, not one producer

    def choices() -> tuple[float, float]:
        text = scrape(router)
        return tuple(  # type: ignore[return-value]
            value(text, "narwhal_placements_total", producer_choice=c)
            - value(before, "narwhal_placements_total", producer_choice=c)
            for c in ("least_loaded", "affinity")
        )

    assert settled(choices, (16.0, 0.0)) == (16.0, 0.0)
    assert [e["load"] for e in (await admin(router))["engines"]] == [None] * 4
    # The supervisor is running (health checks every 0.2 s reach every engine) and reads no /metrics.
    checks = {n: fleet.stats(n)["control_reads"]["health"] for n in BLIND}
    wait_until(lambda: all(fleet.stats(n)["control_reads"]["health"] >= checks[n] + 2 for n in BLIND), 10,
               "two more health checks of every engine")
    assert {n: fleet.stats(n)["control_reads"]["metrics"] for n in BLIND} == dict.fromkeys(BLIND, 0)
