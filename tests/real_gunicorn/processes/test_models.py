"""Which engine serves which model comes from the supervisor (docs/behaviour.md "The request path"),
through
real gunicorn with 2 workers: the supervisor reads the engine's ``/v1/models`` once at its start
(the workers never do), both workers list what it read and refuse any other model with 404
``model_not_found``; an engine restarted with another model is read again as it is readmitted,
and every worker serves the new model and refuses the old one. A model name over the record's
bound (``shm.models``) is left out with one line in the log, and refused like any other.

Each worker is reached on its own keep-alive connection (``sessions_per_worker``); every wait is
on a condition with a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from narwhal.shm.models import MAX_MODEL_BYTES
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    TOKEN,
    completion,
    engine_entry,
    records,
    send,
    sessions_per_worker,
    start_router,
    unique_prompt,
    wait_state,
)

ENGINE = "mb0"
SEEN_WITHIN_S = 10.0  # a readmission is read at once: far below the 30 s refresh


def engine_fleet(model: str, port: int = 0) -> FakeFleet:
    return FakeFleet.start([ENGINE], args=["--model", model, "--port", str(port)])


async def listed(session: aiohttp.ClientSession, router: RouterProcess) -> dict:
    async with session.get(router.url + "/v1/models") as resp:
        assert resp.status == 200
        return orjson.loads(await resp.read())


async def ask(session: aiohttp.ClientSession, router: RouterProcess, model: str) -> tuple[int, dict]:
    async with session.post(router.url + "/v1/completions", json=completion("hi", stream=False, model=model)) as resp:
        return resp.status, orjson.loads(await resp.read())


def ids(listing: dict) -> list[str]:
    return [m["id"] for m in listing["data"]]


def not_found(model: str) -> dict:
    return {"error": {"message": f"The model `{model}` does not exist.", "type": "model_not_found",
                      "param": None, "code": 404}}


async def serves_only(sessions: dict[int, aiohttp.ClientSession], router: RouterProcess, model: str,
                      other: str) -> None:
    """Every worker lists ``model`` alone, serves it, and refuses ``other`` as no engine's."""
    for session in sessions.values():
        listing = await listed(session, router)
        assert listing["object"] == "list" and ids(listing) == [model]
        assert {k: v for k, v in listing["data"][0].items() if k != "created"} == {
            "id": model, "object": "model", "owned_by": "narwhal", "root": model, "parent": None,
            "max_model_len": 8192}  # the engine's card, as its /v1/models said
        status, body = await ask(session, router, model)
        assert status == 200 and body["model"] == model
        assert await ask(session, router, other) == (404, not_found(other))


@pytest.fixture
def first_fleet() -> Iterator[FakeFleet]:
    fleet = engine_fleet("m-one")
    yield fleet
    fleet.stop()


async def test_models_come_from_the_supervisor_and_a_restarted_engine_s_new_model_is_seen_at_readmission(
    first_fleet: FakeFleet, tmp_path: Path
) -> None:
    router = start_router(
        first_fleet, [{"name": ENGINE, "role": "both"}], tmp_path,
        server={"workers": 2, "admin_token": TOKEN},
        recovery={"eject_after": 1, "readmit_interval_s": 0.3, "readmit_interval_max_s": 0.6,
                  "health_interval_s": 0.3},
    )
    restarted: FakeFleet | None = None
    try:
        async with sessions_per_worker(router, 2) as sessions:
            # One read, the supervisor's, for a router of two workers (each read its own before).
            assert first_fleet.stats(ENGINE)["control_reads"]["models"] == 1
            await serves_only(sessions, router, "m-one", other="m-two")
            assert (await engine_entry(router, ENGINE))["models"] == ["m-one"]

            port = urlsplit(first_fleet.engines[ENGINE]).port
            assert port is not None
            first_fleet.stop()  # the engine goes down: its health check ejects it
            await wait_state(router, ENGINE, "ejected")
            restarted = engine_fleet("m-two", port)  # back on its address, serving another model
            await wait_state(router, ENGINE, "admitted")
            end = time.monotonic() + SEEN_WITHIN_S
            while time.monotonic() < end:
                if [ids(await listed(s, router)) for s in sessions.values()] == [["m-two"]] * len(sessions):
                    break
                await asyncio.sleep(0.05)
            assert restarted.stats(ENGINE)["control_reads"]["models"] >= 1  # read at its readmission
            await serves_only(sessions, router, "m-two", other="m-one")
            assert (await engine_entry(router, ENGINE))["models"] == ["m-two"]
    finally:
        router.stop()
        if restarted is not None:
            restarted.stop()


async def test_a_model_name_over_the_bound_is_left_out_logged_once_and_refused_as_no_engine_s(
    first_fleet: FakeFleet, tmp_path: Path
) -> None:
    long = "org/" + "l" * MAX_MODEL_BYTES
    first_fleet.control_request("PUT", f"/engines/{ENGINE}/faults", {"models": ["m-one", long]})
    router = start_router(first_fleet, [{"name": ENGINE, "role": "both"}], tmp_path, server={"workers": 2})
    try:
        async with sessions_per_worker(router, 2) as sessions:
            await serves_only(sessions, router, "m-one", other=long)
        line = f"engine {ENGINE}: 1 model name(s) over {MAX_MODEL_BYTES} bytes left out ('org/{'l' * 36}...')"
        assert router.log_text().count(line) == 1
    finally:
        router.stop()


async def test_the_listing_gives_the_smallest_context_of_a_models_engines(tmp_path: Path) -> None:
    # Clients size requests from max_model_len: a request that fits the smallest fits any engine.
    wide = FakeFleet.start(["mw0"], args=["--model", "m-ctx", "--max-model-len", "4096"])
    narrow = FakeFleet.start(["mn0"], args=["--model", "m-ctx", "--max-model-len", "2048"])
    router = None
    try:
        engines = [{"name": "mw0", "role": "both", "url": wide.engines["mw0"]},
                   {"name": "mn0", "role": "both", "url": narrow.engines["mn0"]}]
        router = start_router(wide, engines, tmp_path, server={"workers": 2, "admin_token": TOKEN})
        async with sessions_per_worker(router, 2) as sessions:
            for session in sessions.values():
                end = time.monotonic() + SEEN_WITHIN_S
                while (card := (await listed(session, router))["data"][0]).get("max_model_len") != 2048:
                    assert time.monotonic() < end, card
                    await asyncio.sleep(0.05)
                assert (card["id"], card["root"]) == ("m-ctx", "m-ctx")
    finally:
        if router is not None:
            router.stop()
        wide.stop()
        narrow.stop()


async def test_an_engine_down_at_start_takes_traffic_as_soon_as_it_answers(
    fleet: FakeFleet, tmp_path: Path
) -> None:
    """Its first read failed (refused); once it answers, its /version and models are read at
    once, not at the next round its health_interval_s pace allows (10 s here), so it takes
    traffic as soon as it serves."""
    fleet.control_request("POST", "/engines/d1/stop")
    router = start_router(fleet, [{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"},
                                  {"name": "d1", "role": "consumer"}], tmp_path,
                          server={"workers": 2, "admin_token": TOKEN}, placement={"load_interval_s": 0.1},
                          recovery={"health_interval_s": 10})
    try:
        assert (await engine_entry(router, "d1"))["models"] == []
        fleet.control_request("POST", "/engines/d1/start")
        started = time.monotonic()

        async def d1_takes_one() -> bool:
            prompt = unique_prompt()
            reply = await send(router.url, "/v1/completions", completion(prompt, max_tokens=2))
            assert reply.status == 200, reply.raw
            return bool(records(fleet, "d1", prompt))

        while not await d1_takes_one():
            assert time.monotonic() - started < 3, "d1 took no request within 3 s of answering"
            await asyncio.sleep(0.05)
    finally:
        fleet.control_request("POST", "/engines/d1/start")
        router.stop()
