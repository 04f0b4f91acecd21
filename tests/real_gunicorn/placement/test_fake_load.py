"""The fake engines' load and cache models as the real router sees them (docs/behaviour.md "Placement", "Fake engines").

The contract between the fake and the router: a consumer made busy behind the router's back
(background load, which only the engine's ``/metrics`` shows) reaches ``/admin/engines`` as that
engine's ``load``, and requests sent through the router fill and hit the producer's prefix cache.
Its own fleet, because these engines run with a batch limit and a prefix cache that the shared
session fleet must not have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import MODEL, TOKEN, completion, engine_entry, send, start_router

ENGINES = ["lp0", "ld0", "ld1"]


@pytest.fixture(scope="module")
def models_fleet() -> Iterator[FakeFleet]:
    args = ["--model", MODEL, "--max-num-seqs", "2", "--prefix-cache", "--kv-blocks", "100"]
    fleet = FakeFleet.start(ENGINES, args=args)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def load_router(models_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines: list[dict[str, Any]] = [
        {"name": "lp0", "role": "producer"},
        {"name": "ld0", "role": "consumer"},
        {"name": "ld1", "role": "consumer"},
    ]
    proc = start_router(
        models_fleet, engines, tmp_path_factory.mktemp("load"),
        server={"workers": 2, "admin_token": TOKEN}, placement={"load_interval_s": 0.1},
    )
    yield proc
    proc.stop()


async def _load_of(router: RouterProcess, name: str) -> Any:
    return (await engine_entry(router, name))["load"]


async def _wait_load(router: RouterProcess, name: str, running: float, waiting: float) -> dict[str, Any]:
    """The engine's published load once it shows ``running`` and ``waiting`` (bounded)."""
    for _ in range(200):
        load = await _load_of(router, name)
        if load is not None and (load["running"], load["waiting"]) == (running, waiting):
            return dict(load)
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name}: load never reached {running}/{waiting}: {await _load_of(router, name)}")


async def test_background_load_reaches_the_routers_load_readings(
    models_fleet: FakeFleet, load_router: RouterProcess
) -> None:
    models_fleet.set_background("ld1", 5, hold_s=60)
    try:
        busy = await _wait_load(load_router, "ld1", 2.0, 3.0)  # 2 slots of max_num_seqs, 3 waiting
        assert busy["age_s"] < 2
        idle = await _load_of(load_router, "ld0")
        assert (idle["running"], idle["waiting"]) == (0.0, 0.0)
    finally:
        models_fleet.set_background("ld1", 0)
    await _wait_load(load_router, "ld1", 0.0, 0.0)


async def test_requests_through_the_router_hit_the_producers_prefix_cache(
    models_fleet: FakeFleet, load_router: RouterProcess
) -> None:
    shared = "".join(f"block {i:02d} ".ljust(64, "x") for i in range(8))  # 8 full blocks, 128 tokens
    before = models_fleet.stats("lp0")["prefix_cache"]
    for tail in ("first question", "second question"):
        reply = await send(load_router.url, "/v1/completions", completion(shared + tail, stream=False))
        assert reply.status == 200, reply.raw
    after = models_fleet.stats("lp0")["prefix_cache"]
    assert after["hits"] - before["hits"] == 128  # the second prefill found the first one's blocks
    # Queried: both prompts, in 4-character tokens (526 and 527 characters: 132 tokens each).
    assert after["queries"] - before["queries"] == 132 + 132
