"""Phase reservations (docs/behaviour.md "Placement", "Cleanup") and client keys ("The request path") through
real gunicorn.

The capped router has one worker: reservations are per worker until the supervisor's
shared-memory counts land, and one worker makes "the cap is held" exact here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import completion, error_of, records, send, start_router, unique_prompt


@pytest.fixture(scope="module")
def capped_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [
        {"name": "p2", "role": "producer", "max_inflight_prefill": 1},
        {"name": "d2", "role": "consumer", "max_inflight_decode": 1},
    ]
    proc = start_router(
        fleet, engines, tmp_path_factory.mktemp("capped"),
        server={"workers": 1}, placement={"queue_timeout_s": 0.5, "retry_after_s": 7},
    )
    yield proc
    proc.stop()


async def test_a_held_decode_slot_makes_the_next_request_wait_then_503(capped_router: RouterProcess) -> None:
    slow = completion(unique_prompt(), max_tokens=40, fake={"decode": {"token_delay_s": 0.05}})
    async with aiohttp.ClientSession() as session:
        resp = await session.post(capped_router.url + "/v1/completions", json=slow)
        assert resp.status == 200
        await resp.content.readany()  # the first stream now holds d2's only decode slot
        reply = await send(capped_router.url, "/v1/completions", completion(unique_prompt()))
        assert reply.status == 503
        assert reply.headers["x-narwhal-error"] == "no_engine"
        assert reply.headers["Retry-After"] == "7"
        assert error_of(reply)["type"] == "no_engine"
        await resp.read()
    # The finished stream gave its slot back.
    assert (await send(capped_router.url, "/v1/completions", completion(unique_prompt()))).status == 200


async def test_a_waiting_request_takes_the_slot_when_it_frees(capped_router: RouterProcess) -> None:
    first = completion(unique_prompt(), max_tokens=4, fake={"decode": {"token_delay_s": 0.05}})
    second = completion(unique_prompt(), max_tokens=2)
    replies = await asyncio.gather(
        send(capped_router.url, "/v1/completions", first),
        send(capped_router.url, "/v1/completions", second),
    )
    assert [r.status for r in replies] == [200, 200]


@pytest.mark.parametrize(
    "fake",
    [
        {"prefill": {"status": 500}},
        {"prefill": {"status": 429}},
        {"prefill": {"descriptor": "bad_blocks"}},
        {"decode": {"status": 503}},
        {"decode": {"done_before_token": True}},
        {"decode": {"close_after": 2}},
        {"decode": {"stream_error": {"code": 500, "message": "x", "after": 1}}},
    ],
    ids=["prefill-5xx", "prefill-429", "invalid-handoff", "decode-5xx", "done-first", "cut", "error-event"],
)
async def test_every_failure_gives_both_slots_back(capped_router: RouterProcess, fake: dict) -> None:
    reply = await send(capped_router.url, "/v1/completions", completion(unique_prompt(), fake=fake))
    assert reply.status != 503
    # With caps of 1, a leaked slot would make this one wait and 503.
    ok = await send(capped_router.url, "/v1/completions", completion(unique_prompt()))
    assert ok.status == 200


async def test_a_departed_client_gives_both_slots_back(capped_router: RouterProcess) -> None:
    slow = completion(unique_prompt(), max_tokens=100, fake={"decode": {"token_delay_s": 0.05}})
    async with aiohttp.ClientSession() as session:
        resp = await session.post(capped_router.url + "/v1/completions", json=slow)
        await resp.content.readany()
        resp.close()
    reply = await send(capped_router.url, "/v1/completions", completion(unique_prompt()))
    assert reply.status == 200


@pytest.fixture(scope="module")
def keyed_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    proc = start_router(
        fleet, engines, tmp_path_factory.mktemp("keyed"),
        server={"api_keys": ["key-one", "key-two"]}, engine={"api_key": "engine-secret"},
    )
    yield proc
    proc.stop()


async def test_client_keys_are_required_and_never_forwarded(keyed_router: RouterProcess, fleet: FakeFleet) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"}):
        reply = await send(keyed_router.url, "/v1/completions", completion(unique_prompt()), headers=headers)
        assert reply.status == 401
        assert reply.headers["x-narwhal-error"] == "unauthorized"
        assert error_of(reply)["type"] == "unauthorized"
    prompt = unique_prompt()
    reply = await send(keyed_router.url, "/v1/completions", completion(prompt),
                       headers={"Authorization": "Bearer key-two"})
    assert reply.status == 200
    for engine in ("p2", "d2"):
        (rec,) = records(fleet, engine, prompt)
        assert rec["headers"]["authorization"] == "Bearer engine-secret"
    # Health and metrics stay open for probes and scrapers.
    assert (await send(keyed_router.url, "/health", method="GET")).status == 200
