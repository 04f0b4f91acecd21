"""Retries, quarantine, fleet-wide caps and process kills through real gunicorn (docs/behaviour.md "Processes", "The
request path", "Recovery").
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import orjson
import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles
from tests.real_gunicorn.fixtures import engines_named, faults_cleared_after_each, router_fixture
from tests.real_gunicorn.support import (
    TOKEN,
    admin,
    at_rest,
    completion,
    engine_entry,
    post,
    readmit_all,
    records,
    scrape,
    send,
    sessions_per_worker,
    settled,
    start_router,
    terminal_error,
    unique_prompt,
    value,
    wait_state,
    wait_until,
)

PRODUCERS = ["sp0", "sp1"]
CONSUMERS = ["sd0", "sd1"]


clean_faults = faults_cleared_after_each(*PRODUCERS, *CONSUMERS)


retry_router = router_fixture(
    engines_named(*PRODUCERS, "sd0"), "sp0, sp1 → sd0, one retry, a budget of two retries.",
    server={"workers": 3, "admin_token": TOKEN},
    recovery={"max_retries": 1, "retry_budget_ratio": 0.0, "retry_budget_min": 2, "eject_after": 1000},
)


quarantine_router = router_fixture(
    engines_named(*PRODUCERS, "sd0"), "sp0, sp1 → sd0, one retry, a failed engine quarantined for 4 s.",
    server={"workers": 3, "admin_token": TOKEN},
    recovery={"max_retries": 1, "failure_quarantine_s": 4.0, "eject_after": 1000},
)


async def test_a_retry_succeeds_on_the_other_producer_with_a_new_request_id(
    retry_router: RouterProcess, fleet: FakeFleet
) -> None:
    fleet.control_request("PUT", "/engines/sp0/faults", {"prefill": {"status": 500}})
    retried = None
    for _ in range(30):  # placement is random among equals: go until one lands on sp0 first
        prompt = unique_prompt()
        reply = await send(retry_router.url, "/v1/completions", completion(prompt))
        assert reply.status == 200, reply.raw
        if records(fleet, "sp0", prompt):
            retried = prompt
            break
    assert retried is not None, "no request was placed on sp0"
    (failed,) = records(fleet, "sp0", retried)
    (good,) = records(fleet, "sp1", retried)
    (decode,) = records(fleet, "sd0", retried)
    assert failed["headers"]["x-request-id"] != good["headers"]["x-request-id"]
    assert decode["headers"]["x-request-id"] == good["headers"]["x-request-id"]
    assert decode["body"]["kv_transfer_params"]["remote_engine_id"] == fleet.stats("sp1")["engine_id"]


async def test_quarantine_keeps_every_worker_off_the_engine_then_lets_it_back(
    quarantine_router: RouterProcess, fleet: FakeFleet
) -> None:
    await readmit_all(quarantine_router, PRODUCERS)
    await wait_until_admitted(quarantine_router, "sp0")
    fleet.control_request("PUT", "/engines/sp0/faults", {"prefill": {"status": 500}})
    for _ in range(30):
        prompt = unique_prompt()
        assert (await send(quarantine_router.url, "/v1/completions", completion(prompt))).status == 200
        if records(fleet, "sp0", prompt):
            break
    failed_at = time.monotonic()
    fleet.control_request("DELETE", "/engines/sp0/faults")
    entry = await wait_state(quarantine_router, "sp0", "quarantined", timeout=1)
    assert entry["quarantined_until"] > time.time()
    async with sessions_per_worker(quarantine_router, 3) as sessions:
        prompts = []
        for session in list(sessions.values()) * 3:
            prompt = unique_prompt()
            prompts.append(prompt)
            status, _ = await post(session, quarantine_router, completion(prompt))
            assert status == 200
    assert time.monotonic() - failed_at < 3.5, "too slow to observe the quarantine window"
    assert all(not records(fleet, "sp0", p) for p in prompts)
    await wait_state(quarantine_router, "sp0", "admitted", timeout=8)
    assert time.monotonic() - failed_at >= 3.9


async def wait_until_admitted(router: RouterProcess, name: str) -> None:
    await wait_state(router, name, "admitted", timeout=5)


async def test_no_retry_after_visible_output(retry_router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    reply = await send(retry_router.url, "/v1/completions",
                       completion(prompt, max_tokens=6, fake={"decode": {"close_after": 2}}))
    assert reply.status == 200
    assert terminal_error(reply)["type"] == "engine_disconnect"
    assert len(records(fleet, "sd0", prompt)) == 1


async def test_the_retry_budget_stops_a_retry_storm(retry_router: RouterProcess, fleet: FakeFleet) -> None:
    await readmit_all(retry_router, PRODUCERS)
    for name in PRODUCERS:  # every prefill fails after 0.5 s: all ten fail at once
        fleet.control_request("PUT", f"/engines/{name}/faults", {"prefill": {"status": 500, "delay_headers_s": 0.5}})
    before = at_rest(retry_router, "narwhal_retries_total", "narwhal_retry_budget_exhausted_total")
    retries, exhausted = value(before, "narwhal_retries_total"), value(before, "narwhal_retry_budget_exhausted_total")
    replies = await asyncio.gather(
        *(send(retry_router.url, "/v1/completions", completion(unique_prompt())) for _ in range(10))
    )
    assert [r.status for r in replies] == [502] * 10
    # retry_budget_min = 2 and ratio 0: two retries at most, the other eight refused.
    after = scrape(retry_router)  # both counted before the replies went out (no tally)
    assert value(after, "narwhal_retries_total") - retries == 2
    assert value(after, "narwhal_retry_budget_exhausted_total") - exhausted == 8


capped_fleet_router = router_fixture(
    [*engines_named("sp1"), *engines_named("sd1", max_inflight_decode=1)], "sp1 → sd1 capped at one stream, 3 workers.",
    server={"workers": 3, "admin_token": TOKEN}, placement={"queue_timeout_s": 15},
)


async def test_a_cap_of_one_never_holds_two_streams_whichever_workers_serve_them(
    capped_fleet_router: RouterProcess, fleet: FakeFleet
) -> None:
    async with sessions_per_worker(capped_fleet_router, 3) as sessions:
        bodies = [completion(unique_prompt(), max_tokens=5, fake={"decode": {"token_delay_s": 0.06}})
                  for _ in range(6)]
        started = time.monotonic()
        pairs = zip(list(sessions.values()) * 2, bodies, strict=True)
        results = await asyncio.gather(*(post(session, capped_fleet_router, body) for session, body in pairs))
        elapsed = time.monotonic() - started
    assert [status for status, _ in results] == [200] * 6
    # Each stream takes ≥ 0.24 s; six of them one at a time take ≥ 1.44 s (in parallel: ~0.3 s).
    assert elapsed >= 1.4


async def test_a_killed_worker_gives_its_reservations_back(
    capped_fleet_router: RouterProcess, fleet: FakeFleet
) -> None:
    async with sessions_per_worker(capped_fleet_router, 3) as sessions:
        victim, session = next(iter(sessions.items()))
        body = completion(unique_prompt(), max_tokens=400, fake={"decode": {"token_delay_s": 0.05}})
        resp = await session.post(capped_fleet_router.url + "/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readany()  # the victim worker now holds sd1's only decode slot
        assert (await engine_entry(capped_fleet_router, "sd1"))["inflight"]["decode"] == 1
        os.kill(victim, signal.SIGKILL)
        resp.close()
    end = time.monotonic() + 10
    while (await engine_entry(capped_fleet_router, "sd1"))["inflight"]["decode"] != 0:
        assert time.monotonic() < end, "the dead worker's decode slot was never given back"
        await asyncio.sleep(0.05)
    reply = await send(capped_fleet_router.url, "/v1/completions", completion(unique_prompt()),
                       headers={"x-narwhal-deadline-s": "5"})
    assert reply.status == 200


def _supervisor_pid(router: RouterProcess) -> int | None:
    found = router_roles(router.proc.pid)["supervisor"]
    return found[0] if found else None


async def test_kill_9_of_the_supervisor_mid_load_loses_no_request(
    retry_router: RouterProcess, fleet: FakeFleet
) -> None:
    await readmit_all(retry_router, PRODUCERS)
    old = _supervisor_pid(retry_router)
    assert old is not None

    async def load() -> list[int]:
        statuses = []
        for _ in range(15):
            reply = await send(retry_router.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
            statuses.append(reply.status)
        return statuses

    task = asyncio.ensure_future(asyncio.gather(*(load() for _ in range(4))))
    await asyncio.sleep(0.2)
    os.kill(old, signal.SIGKILL)
    statuses = [s for batch in await task for s in batch]
    assert statuses == [200] * 60
    wait_until(lambda: _supervisor_pid(retry_router) not in (None, old), 5, "a new supervisor")
    # The new supervisor runs the fleet: an operator action goes through it.
    await admin(retry_router, "POST", "/admin/engines/sp1/drain")
    assert (await engine_entry(retry_router, "sp1"))["state"] == "draining"
    await admin(retry_router, "POST", "/admin/engines/sp1/readmit")
    assert "narwhal_supervisor_restarts_total 1.0" in http_get(retry_router.url + "/metrics")[1].decode()


def _restarts(router: RouterProcess) -> float:
    text = http_get(router.url + "/metrics")[1].decode()
    match = re.search(r"^narwhal_supervisor_restarts_total ([0-9.]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_a_wedged_supervisor_is_replaced_once(retry_router: RouterProcess) -> None:
    # SIGSTOP: alive but beating no more. The master's keeper replaces it after its heartbeat is
    # STALE_S old, once, and a new supervisor is not taken for wedged while it starts.
    old = _supervisor_pid(retry_router)
    assert old is not None
    before = _restarts(retry_router)
    os.kill(old, signal.SIGSTOP)
    try:
        wait_until(lambda: _supervisor_pid(retry_router) not in (None, old), 15, "a new supervisor")
        reply = await send(retry_router.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
        assert reply.status == 200
        assert settled(lambda: _restarts(retry_router), before + 1) == before + 1
    finally:
        if _supervisor_pid(retry_router) == old:
            os.kill(old, signal.SIGCONT)


async def test_a_consumer_is_probed_with_a_handoff_from_its_original_producer(
    fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Two consumers, so a producer is never charged for its only consumer's faults (docs/behaviour.md "Recovery");
    # sd1 is drained, so every decode goes to sd0.
    engines = [{"name": n, "role": "producer"} for n in PRODUCERS]
    engines += [{"name": n, "role": "consumer"} for n in CONSUMERS]
    router = start_router(
        fleet, engines, tmp_path_factory.mktemp("probe"),
        server={"workers": 2, "admin_token": TOKEN},
        recovery={"eject_after": 2, "readmit_interval_s": 0.4, "readmit_interval_max_s": 0.4,
                  "health_interval_s": 30},
        engine_contract={"model": "fake-model", "engine_version": "0.33.0"},
    )
    try:
        await admin(router, "POST", "/admin/engines/sd1/drain")
        # sd0 fails every crossed decode before its first token, with both producers: its fault.
        fleet.control_request("PUT", "/engines/sd0/faults", {"decode": {"status": 500}})
        ejected = False
        for _ in range(40):
            await send(router.url, "/v1/completions", completion(unique_prompt()))
            # Wait until the supervisor has heard this one (it publishes within ~20 ms), so the
            # request after which sd0 is out is the one that ejected it: its original producer.
            end = time.monotonic() + 0.3
            while time.monotonic() < end and not ejected:
                ejected = (await engine_entry(router, "sd0"))["state"] in ("ejected", "probing")
                await asyncio.sleep(0.01)
            if ejected:
                break
        await wait_state(router, "sd0", "ejected")
        for p in PRODUCERS:  # one broken consumer never takes its producers out
            assert (await engine_entry(router, p))["state"] == "admitted"
        decodes = fleet.control_request("GET", "/engines/sd0/requests")["requests"]
        # The client's completions only (not the supervisor's probes, nor its generate question).
        failed = [r for r in decodes if r["path"] == "/v1/completions" and r["body"].get("narwhal_fake") is None
                  and "probe" not in r["body"]["prompt"]]
        original_id = failed[-1]["body"]["kv_transfer_params"]["remote_engine_id"]
        original = next(p for p in PRODUCERS if fleet.stats(p)["engine_id"] == original_id)
        # The original producer is down: the probe cannot decide, and sd0 stays out.
        fleet.control_request("DELETE", "/engines/sd0/faults")
        fleet.control_request("POST", f"/engines/{original}/stop")
        await asyncio.sleep(1.5)
        assert (await engine_entry(router, "sd0"))["state"] in ("ejected", "probing")
        probes = fleet.control_request("GET", "/engines/sd0/requests?contains=narwhal%20probe")["requests"]
        seen = len(probes)
        # It comes back: now the probe decodes a new handoff made by that same producer.
        fleet.control_request("POST", f"/engines/{original}/start")
        await wait_state(router, "sd0", "admitted", timeout=10)
        probes = fleet.control_request("GET", "/engines/sd0/requests?contains=narwhal%20probe")["requests"]
        assert len(probes) > seen
        assert probes[-1]["body"]["kv_transfer_params"]["remote_engine_id"] == fleet.stats(original)["engine_id"]
        assert probes[-1]["body"]["stream"] is True
    finally:
        router.stop()


async def test_a_whole_wave_comes_back_together(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> None:
    engines = [{"name": "sp1", "role": "producer"},
               {"name": "sd0", "role": "consumer", "wave": "rack-a"},
               {"name": "sd1", "role": "consumer", "wave": "rack-a"}]
    router = start_router(
        fleet, engines, tmp_path_factory.mktemp("wave"),
        server={"workers": 2, "admin_token": TOKEN},
        recovery={"eject_after": 2, "readmit_interval_s": 0.3, "readmit_interval_max_s": 0.3,
                  "health_interval_s": 0.2, "wave_hold_s": 60},
    )
    try:
        for name in ("sd0", "sd1"):
            fleet.control_request("PUT", f"/engines/{name}/faults", {"health_status": 503})
        await wait_state(router, "sd0", "ejected")
        await wait_state(router, "sd1", "ejected")
        fleet.control_request("DELETE", "/engines/sd0/faults")  # sd0 recovers, sd1 not yet
        await asyncio.sleep(1.5)  # several probe rounds: sd0 passes, but waits for its wave
        assert (await engine_entry(router, "sd0"))["state"] == "ejected"
        fleet.control_request("DELETE", "/engines/sd1/faults")
        await wait_state(router, "sd1", "admitted", timeout=10)
        assert (await engine_entry(router, "sd0"))["state"] == "admitted"
        assert orjson.loads(http_get(router.url + "/ready")[1]) == {"ready": True}
    finally:
        router.stop()
