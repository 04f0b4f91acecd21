"""The supervisor and shared fleet state through real gunicorn with 3 workers (docs/behaviour.md "Processes",
"Recovery").

Workers are told apart by keep-alive connections: a connection stays with the worker that
accepted it, and ``/health`` names that worker's pid. So "three failures seen by three
different workers" is arranged, not hoped for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import orjson
import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import engines_named, faults_cleared_after_each, router_fixture
from tests.real_gunicorn.support import (
    TOKEN,
    admin,
    completion,
    engine_entry,
    error_of,
    post,
    readmit_all,
    records,
    records_anywhere,
    send,
    sessions_per_worker,
    start_router,
    unique_prompt,
    wait_state,
    wait_until,
)

PRODUCERS = ["sp0", "sp1"]
CONSUMERS = ["sd0", "sd1"]


sup_router = router_fixture(
    engines_named(*PRODUCERS, *CONSUMERS), "Both producers and consumers, 3 workers, ejection after 3 failures; "
    "with a contract, readmission is lifecycle validation plus an inference probe.",
    server={"workers": 3, "admin_token": TOKEN},
    recovery={"eject_after": 3, "readmit_interval_s": 0.5, "readmit_interval_max_s": 1, "health_interval_s": 0.5},
    engine_contract={"model": "fake-model", "engine_version": "0.33.0", "kv_connector": "NixlConnector"},
)


health_router = router_fixture(
    engines_named("sp1", "sd1"), "No engine contract: a development fleet, readmitted by a passing health check.",
    server={"workers": 2, "admin_token": TOKEN},
    recovery={"eject_after": 2, "readmit_interval_s": 0.5, "readmit_interval_max_s": 1, "health_interval_s": 0.3},
)


clean_faults = faults_cleared_after_each(*PRODUCERS, *CONSUMERS)


async def test_admin_api_needs_the_token(sup_router: RouterProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}):
        reply = await send(sup_router.url, "/admin/engines", method="GET", headers=headers)
        assert reply.status == 401
        assert error_of(reply)["type"] == "unauthorized"
    body = await admin(sup_router)
    names = [e["name"] for e in body["engines"]]
    assert names == PRODUCERS + CONSUMERS
    entry = body["engines"][0]
    assert set(entry) == {"name", "url", "role", "wave", "models", "version", "transfer_mode", "refused_endpoints",
                          "state", "failure_streak", "ejections", "unreachable", "quarantined_until", "inflight",
                          "last_failure", "load", "holdings"}
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
        assert visible_after < 2.0  # ~10 ms measured; generous for a loaded CI machine
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
    wanted = "probe of sd0 (probe): fail: health: HTTP 503"  # lifecycle validation, its first step
    wait_until(lambda: wanted in _messages(sup_router), 10, "the failed probe's line, with its reason")
    fleet.control_request("DELETE", "/engines/sd0/faults")
    entry = await wait_state(sup_router, "sd0", "admitted", timeout=10)
    assert entry["failure_streak"] == 0
    # The readmission decoded a real probe stream on sd0, and the probes were counted.
    probes = records_anywhere(fleet, "narwhal probe", ["sd0"]).get("sd0", [])
    assert len(probes) > before and probes[-1]["body"]["stream"] is True
    text = http_get(sup_router.url + "/metrics")[1].decode()
    assert 'narwhal_probes_total{engine="sd0",result="pass"} 1.0' in text
    assert 'narwhal_probes_total{engine="sd0",result="fail"}' in text


def _messages(router: RouterProcess) -> set[str]:
    """The messages of the router's JSON log lines (gunicorn's and the supervisor's alike)."""
    found = set()
    with open(router.log_path, "rb") as f:
        for raw in f:
            with contextlib.suppress(orjson.JSONDecodeError):
                line = orjson.loads(raw)
                if isinstance(line, dict) and "message" in line:
                    found.add(line["message"])
    return found


async def test_without_a_contract_a_passing_health_check_readmits(
    health_router: RouterProcess, fleet: FakeFleet
) -> None:
    fleet.control_request("PUT", "/engines/sd1/faults", {"health_status": 503})
    entry = await wait_state(health_router, "sd1", "ejected")
    assert entry["last_failure"]["reason"] == "health_check"
    # Every failed check and probe says why, in the router's (JSON) log.
    wanted = {"health check of sd1: fail: HTTP 503", "probe of sd1 (health): fail: HTTP 503"}
    wait_until(lambda: wanted <= _messages(health_router), 10, "the failed check and probe lines, with reasons")
    fleet.control_request("DELETE", "/engines/sd1/faults")
    entry = await wait_state(health_router, "sd1", "admitted", timeout=10)
    assert entry["failure_streak"] == 0


async def test_ready_follows_the_admitted_pairs(sup_router: RouterProcess) -> None:
    await readmit_all(sup_router, PRODUCERS + CONSUMERS)
    for name in CONSUMERS:
        await admin(sup_router, "POST", f"/admin/engines/{name}/eject")
    try:
        reply = await send(sup_router.url, "/ready", method="GET")
        assert reply.status == 503
        out = ", ".join(f"{n} ejected by the operator" for n in sorted(CONSUMERS))
        assert reply.json == {"ready": False, "reason": "no producer->consumer pair for model 'fake-model' is in "
                              f"service and reachable: {out}"}
        refused = await send(sup_router.url, "/v1/completions", completion(unique_prompt()))
        assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        assert error_of(refused)["type"] == "no_engine"
        assert error_of(refused)["message"].endswith(  # which engines, and why each is out
            ", ".join(f"{n} ejected by the operator" for n in sorted(CONSUMERS)))
    finally:
        await readmit_all(sup_router, CONSUMERS)
    assert (await send(sup_router.url, "/ready", method="GET")).status == 200


async def test_a_drained_engine_finishes_its_streams_and_takes_no_new_ones(
    sup_router: RouterProcess, fleet: FakeFleet
) -> None:
    await readmit_all(sup_router, PRODUCERS + CONSUMERS)
    await admin(sup_router, "POST", "/admin/engines/sd1/drain")
    prompt = unique_prompt()
    body = completion(prompt, max_tokens=12, fake={"decode": {"token_delay_s": 0.05}})
    async with aiohttp.ClientSession() as session:
        resp = await session.post(sup_router.url + "/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readany()  # streaming from sd0, the only consumer left
        entry = await admin(sup_router, "POST", "/admin/engines/sd0/drain")
        assert entry["state"] == "draining"
        raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")  # the drained engine finished what it had
    refused = await send(sup_router.url, "/v1/completions", completion(unique_prompt()))
    assert refused.status == 503
    await readmit_all(sup_router, CONSUMERS)
    assert records(fleet, "sd0", prompt)[0]["outcome"] == "completed"


@pytest.fixture(scope="module")
def preflight_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    fleet.control_request("PUT", "/engines/sp1/faults", {"version": "0.10.0"})
    engines = [{"name": n, "role": "producer"} for n in PRODUCERS] + [{"name": "sd0", "role": "consumer"}]
    try:
        proc = start_router(
            fleet, engines, tmp_path_factory.mktemp("preflight"),
            server={"workers": 2, "admin_token": TOKEN},
            preflight={"on_start": True},
            recovery={"readmit_interval_s": 60, "readmit_interval_max_s": 60},
            engine_contract={"model": "fake-model", "engine_version": ">=0.33,<0.34"},
        )
    finally:
        fleet.control_request("DELETE", "/engines/sp1/faults")
    yield proc
    proc.stop()


async def test_an_engine_failing_preflight_at_start_starts_ejected(
    preflight_router: RouterProcess, fleet: FakeFleet
) -> None:
    entry = await engine_entry(preflight_router, "sp1")
    assert entry["state"] == "ejected"
    assert entry["last_failure"]["reason"] == "preflight" and entry["ejections"] == 1
    assert (await engine_entry(preflight_router, "sp0"))["state"] == "admitted"
    prompts = [unique_prompt() for _ in range(6)]
    for prompt in prompts:
        assert (await send(preflight_router.url, "/v1/completions", completion(prompt))).status == 200
    assert all(not records(fleet, "sp1", p) for p in prompts)
    assert "version 0.10.0 does not match >=0.33,<0.34" in preflight_router.log_text()
