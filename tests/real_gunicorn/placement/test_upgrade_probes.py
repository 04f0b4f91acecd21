"""Probes pair like placement during a rolling upgrade (docs/behaviour.md, "Recovery": probes pair like placement).

A fleet half way through an upgrade: an old producer listed first and healthy with an old
consumer, a new producer, and a new consumer that comes up after the router. With
``[engine_contract]`` the new consumer is readmitted by an inference probe; the probe must take
its handoff from a producer of its own version, or NIXL refuses it every time and the consumer
stays out until every old producer is gone. The same holds for a consumer that joins through the
discovery file. No fake counts an ``incompatible_decodes``: no incompatible pair is ever tried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.processes.test_discovery import write_engines
from tests.real_gunicorn.support import MODEL, TOKEN, admin, completion, send, start_router, unique_prompt

pytestmark = pytest.mark.timeout(90)

OLD, NEW = "0.32.0", "0.33.0"
NAMES = ["p_old", "p_new", "d_old", "d_new"]
STATIC = [{"name": "p_old", "role": "producer"}, {"name": "p_new", "role": "producer"},
          {"name": "d_old", "role": "consumer"}]
READMIT_S = 0.5
BOUND_S = 15.0  # readmission within a few intervals; generous for a loaded 2-core host


@pytest.fixture(scope="module")
def upgrading() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(NAMES, args=["--vllm-version", NEW, "--model", MODEL, "--lease-s", "60"])
    for name in ("p_old", "d_old"):  # these two still run the old release
        fleet.control_request("POST", f"/engines/{name}/stop")
        fleet.control_request("POST", f"/engines/{name}/start?restart=1&version={OLD}")
    yield fleet
    fleet.stop()


def _router(fleet: FakeFleet, tmp: Path, engines: list[dict[str, str]], **sections: dict[str, object]) -> RouterProcess:
    return start_router(
        fleet, engines, tmp, server={"workers": 2, "admin_token": TOKEN},
        preflight={"on_start": True},
        recovery={"eject_after": 2, "readmit_interval_s": READMIT_S, "readmit_interval_max_s": READMIT_S},
        engine_contract={"model": MODEL}, log={"level": "info"}, **sections,
    )


async def _state(router: RouterProcess, name: str) -> str | None:
    """The engine's state, once the router also knows what it serves (``None`` before)."""
    for entry in (await admin(router))["engines"]:
        if entry["name"] == name and MODEL in entry["models"]:
            return str(entry["state"])
    return None


async def _admitted_within(router: RouterProcess, name: str, bound_s: float) -> float:
    start = time.monotonic()
    while (state := await _state(router, name)) != "admitted":
        waited = time.monotonic() - start
        assert waited < bound_s, f"{name} still {state} after {bound_s}s:\n{router.log_text()[-3000:]}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def _incompatible(fleet: FakeFleet) -> dict[str, int]:
    return {name: fleet.stats(name)["incompatible_decodes"] for name in NAMES}


async def _serves_through_new_pair(router: RouterProcess, fleet: FakeFleet) -> None:
    before = fleet.stats("d_new")["requests"]["decode"]
    await admin(router, "POST", "/admin/engines/d_old/drain")
    start = time.monotonic()
    while await _state(router, "d_old") == "admitted":  # until the drain is published
        assert time.monotonic() - start < BOUND_S, "d_old's drain never showed"
        await asyncio.sleep(0.05)
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
    assert reply.status == 200, reply.raw
    assert fleet.stats("d_new")["requests"]["decode"] > before
    await admin(router, "POST", "/admin/engines/d_old/readmit")


async def test_a_new_consumer_is_readmitted_through_a_producer_of_its_version(
    upgrading: FakeFleet, tmp_path: Path
) -> None:
    upgrading.control_request("POST", "/engines/d_new/stop")  # down when the router starts
    router = _router(upgrading, tmp_path, [dict(e) for e in STATIC] + [{"name": "d_new", "role": "consumer"}])
    try:
        assert await _state(router, "d_new") in ("ejected", "probing", None)
        upgrading.control_request("POST", "/engines/d_new/start")
        await _admitted_within(router, "d_new", BOUND_S)
        await _admitted_within(router, "p_new", BOUND_S)  # it failed preflight too: no consumer of its version
        await _serves_through_new_pair(router, upgrading)
        assert _incompatible(upgrading) == dict.fromkeys(NAMES, 0)
    finally:
        router.stop()


async def test_a_new_consumer_joining_by_the_discovery_file_is_admitted(upgrading: FakeFleet, tmp_path: Path) -> None:
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [])
    router = _router(upgrading, tmp_path, [dict(e) for e in STATIC],
                     discovery={"file": str(engines_file), "interval_s": 0.2})
    try:
        write_engines(engines_file, [{"name": "d_new", "url": upgrading.engines["d_new"], "role": "consumer"}])
        await _admitted_within(router, "d_new", BOUND_S)
        # p_new failed preflight (no consumer of its version then): readmitted by its own probe,
        # which may come a readmit interval after d_new's.
        await _admitted_within(router, "p_new", BOUND_S)
        await _serves_through_new_pair(router, upgrading)
        assert _incompatible(upgrading) == dict.fromkeys(NAMES, 0)
    finally:
        router.stop()
