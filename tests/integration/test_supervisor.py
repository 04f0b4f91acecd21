"""The supervisor and shared fleet state through real gunicorn with 3 workers (SPEC §1, §5, §6).

Workers are told apart by keep-alive connections: a connection stays with the worker that
accepted it, and ``/health`` names that worker's pid. So "three failures seen by three
different workers" is arranged, not hoped for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from narwhal.harness import FakeFleet, RouterProcess, http_get
from tests.integration.admin_helpers import (
    TOKEN,
    admin,
    engine_entry,
    post,
    readmit_all,
    sessions_per_worker,
    wait_state,
)
from tests.integration.conftest import records, records_anywhere, start_router, unique_prompt, wait_until
from tests.integration.helpers import completion, error_of, send

PRODUCERS = ["sp0", "sp1"]
CONSUMERS = ["sd0", "sd1"]


@pytest.fixture(scope="module")
def sup_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": n, "role": "producer"} for n in PRODUCERS]
    engines += [{"name": n, "role": "consumer"} for n in CONSUMERS]
    proc = start_router(
        fleet, engines, tmp_path_factory.mktemp("sup"),
        server={"workers": 3, "admin_token": TOKEN},
        recovery={"eject_after": 3, "readmit_interval_s": 0.5, "readmit_interval_max_s": 1, "health_interval_s": 0.5},
        # With a contract, readmission is lifecycle validation plus an inference probe.
        engine_contract={"model": "fake-model", "engine_version": "0.11.0", "kv_connector": "NixlConnector"},
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def health_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """No engine contract: a development fleet, readmitted by a passing health check."""
    engines = [{"name": "sp1", "role": "producer"}, {"name": "sd1", "role": "consumer"}]
    proc = start_router(
        fleet, engines, tmp_path_factory.mktemp("health"),
        server={"workers": 2, "admin_token": TOKEN},
        recovery={"eject_after": 2, "readmit_interval_s": 0.5, "readmit_interval_max_s": 1, "health_interval_s": 0.3},
    )
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def clean_faults(fleet: FakeFleet) -> Iterator[None]:
    yield
    for name in PRODUCERS + CONSUMERS:
        fleet.control_request("DELETE", f"/engines/{name}/faults")


async def test_admin_api_needs_the_token(sup_router: RouterProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}):
        reply = await send(sup_router.url, "/admin/engines", method="GET", headers=headers)
        assert reply.status == 401
        assert error_of(reply)["type"] == "unauthorized"
    body = await admin(sup_router)
    names = [e["name"] for e in body["engines"]]
    assert names == PRODUCERS + CONSUMERS
    entry = body["engines"][0]
    assert set(entry) == {"name", "url", "role", "wave", "models", "state", "failure_streak", "ejections",
                          "quarantined_until", "inflight", "last_failure"}
    assert entry["models"] == ["fake-model"] and entry["wave"] is None and entry["last_failure"] is None


@pytest.fixture
async def per_worker(sup_router: RouterProcess) -> AsyncIterator[dict[int, aiohttp.ClientSession]]:
    async with sessions_per_worker(sup_router, 3) as sessions:
        yield sessions


async def test_failures_seen_by_three_workers_add_up_to_one_ejection(
    sup_router: RouterProcess, fleet: FakeFleet, per_worker: dict[int, aiohttp.ClientSession]
) -> None:
    await readmit_all(sup_router, PRODUCERS + CONSUMERS)
    await admin(sup_router, "POST", "/admin/engines/sp1/drain")  # every prefill now goes to sp0
    fleet.control_request("PUT", "/engines/sp0/faults", {"prefill": {"status": 500}})
    try:
        for pid, session in per_worker.items():  # one failure in each worker
            status, _ = await post(session, sup_router, completion(unique_prompt()))
            assert status == 502, pid
        started = time.monotonic()
        entry = await wait_state(sup_router, "sp0", "ejected", timeout=5)
        visible_after = time.monotonic() - started
        assert entry["failure_streak"] == 3 and entry["ejections"] == 1
        assert entry["last_failure"]["reason"] == "engine_5xx"
        assert visible_after < 1.0
    finally:
        await admin(sup_router, "POST", "/admin/engines/sp1/readmit")
    # No worker places on the ejected engine any more.
    prompts = [unique_prompt() for _ in range(9)]
    for i, session in enumerate(list(per_worker.values()) * 3):
        status, _ = await post(session, sup_router, completion(prompts[i]))
        assert status == 200
    assert all(records(fleet, "sp0", p) == [] for p in prompts)
    sample = 'narwhal_engine_state{engine="sp0",role="producer"} 2.0'
    wait_until(lambda: sample in http_get(sup_router.url + "/metrics")[1].decode(), 5, "the ejected state exported")


async def test_a_dead_engine_is_ejected_and_readmitted_by_a_probe_once_it_recovers(
    sup_router: RouterProcess, fleet: FakeFleet
) -> None:
    await readmit_all(sup_router, PRODUCERS + CONSUMERS)
    # vLLM's dead-engine answer: the supervisor's health checks count it as failures …
    fleet.control_request("PUT", "/engines/sd0/faults", {"health_status": 503})
    entry = await wait_state(sup_router, "sd0", "ejected")
    assert entry["last_failure"]["reason"] == "health_check" and entry["ejections"] >= 1
    before = len(records_anywhere(fleet, "narwhal probe", ["sd0"]).get("sd0", []))
    # … it stays out while lifecycle validation fails, and comes back once it passes.
    await asyncio.sleep(1.2)
    assert (await engine_entry(sup_router, "sd0"))["state"] in ("ejected", "probing")
    fleet.control_request("DELETE", "/engines/sd0/faults")
    entry = await wait_state(sup_router, "sd0", "admitted", timeout=10)
    assert entry["failure_streak"] == 0
    # The readmission decoded a real probe stream on sd0.
    probes = records_anywhere(fleet, "narwhal probe", ["sd0"]).get("sd0", [])
    assert len(probes) > before and probes[-1]["body"]["stream"] is True


async def test_without_a_contract_a_passing_health_check_readmits(
    health_router: RouterProcess, fleet: FakeFleet
) -> None:
    fleet.control_request("PUT", "/engines/sd1/faults", {"health_status": 503})
    entry = await wait_state(health_router, "sd1", "ejected")
    assert entry["last_failure"]["reason"] == "health_check"
    fleet.control_request("DELETE", "/engines/sd1/faults")
    entry = await wait_state(health_router, "sd1", "admitted", timeout=10)
    assert entry["failure_streak"] == 0
