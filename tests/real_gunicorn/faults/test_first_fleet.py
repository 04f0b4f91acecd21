"""The first real fleet, one producer and one consumer, as docs/behaviour.md "Recovery" says of it,
through real gunicorn: ``deploy/narwhal.toml``'s ``max_ejected_fraction = 0.5``, which can never
eject a role of one engine.

A fleet of its own, with a 3 s lease: every handoff made while the only consumer is dead has
nobody to decode or release it, so only the producer's lease frees it (as on vLLM), and the
module ends once it has.

Before these rules a dead only-consumer left ``/ready`` at 200 (it was never ejected), the
healthy producer was charged for the consumer's refused connections, and a consumer kept
``degraded`` stayed so until a client request happened to succeed on it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import engines_named, faults_cleared_after_each, router_fixture
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    completion,
    engine_entry,
    error_of,
    scrape,
    send,
    unique_prompt,
    value,
    wait_state,
    wait_until,
)

HEALTH_S = 0.5
LEASE_S = 3.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(["p0", "d0"], args=["--model", MODEL, "--block-size", "4", "--lease-s", str(LEASE_S)])
    yield fleet
    wait_until(lambda: fleet.stats("p0")["held_blocks"] == 0, LEASE_S + 5, "p0's stranded handoffs freed by its lease")
    fleet.stop()


_cleared = faults_cleared_after_each("p0", "d0")

first = router_fixture(
    engines_named("p0", "d0"), "p0 → d0; the example's breakers: eject after 2, at most half a role ejected.",
    server={"workers": 2, "admin_token": TOKEN}, handoff={"max_age_s": LEASE_S - 0.2, "lease_s": LEASE_S},
    recovery={"eject_after": 2, "max_ejected_fraction": 0.5, "health_interval_s": HEALTH_S,
              "readmit_interval_s": HEALTH_S},
    log={"level": "info"},
)


async def _ready(router: RouterProcess) -> tuple[int, dict]:
    reply = await send(router.url, "/ready", method="GET")
    return reply.status, reply.json


async def _until(check: object, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await check():  # type: ignore[operator]
        assert loop.time() < end, f"timed out after {timeout}s waiting for: {what}"
        await asyncio.sleep(0.05)


def test_the_counters_the_alerts_and_dashboard_read_exist_from_the_first_scrape(first: RouterProcess) -> None:
    """Before any traffic: each at zero, per engine where labelled (no panel says "No data")."""
    wanted = [
        'narwhal_engine_failures_total{engine="p0",phase="prefill",reason="engine_unreachable"} 0.0',
        'narwhal_engine_failures_total{engine="d0",phase="decode",reason="engine_disconnect"} 0.0',
        'narwhal_engine_failures_total{engine="d0",phase="health",reason="health_check"} 0.0',
        'narwhal_probes_total{engine="d0",result="pass"} 0.0',
        'narwhal_probes_total{engine="p0",result="fail"} 0.0',
        'narwhal_stream_aborted_total{reason="engine_disconnect"} 0.0',
        'narwhal_slow_clients_cut_total{why="write_timeout"} 0.0',
        'narwhal_migration_budget_exhausted_total 0.0',
    ]
    wait_until(lambda: all(line in scrape(first) for line in wanted), 5, "every series at zero")


def test_a_role_of_one_is_said_at_start(first: RouterProcess) -> None:
    log = first.log_text()
    for role, name in (("producer", "p0"), ("consumer", "d0")):
        line = (f"role {role} has 1 engine(s) ({name}): recovery.max_ejected_fraction 0.5 never ejects one; a failing "
                "one stays degraded, probed once it answers health checks again")
        assert log.count(line) == 1, log[-3000:]  # once, by the master: not once per process
    for name in ("p0", "d0"):  # what the supervisor read, said by it alone (not again by each worker)
        assert log.count(f"engine {name} serves ['fake-model']") == 1, log[-3000:]
        assert log.count(f"engine {name} runs vLLM 0.33.0") == 1, log[-3000:]


async def test_a_dead_only_consumer_makes_ready_503_and_charges_it_alone(
    first: RouterProcess, fleet: FakeFleet
) -> None:
    await wait_state(first, "d0", "admitted")
    assert await _ready(first) == (200, {"ready": True})
    before_p0 = sum(value(scrape(first), "narwhal_engine_failures_total", engine="p0", phase=phase, reason=reason)
                    for phase in ("prefill", "decode") for reason in ("engine_unreachable", "engine_disconnect"))
    fleet.control_request("POST", "/engines/d0/stop")
    started = asyncio.get_running_loop().time()

    async def unready() -> bool:
        return (await _ready(first))[0] == 503

    await _until(unready, 4 * HEALTH_S + 1, "/ready 503")
    assert asyncio.get_running_loop().time() - started < 4 * HEALTH_S + 1  # within about one health interval
    status, body = await _ready(first)
    assert body == {"ready": False, "reason": "no producer->consumer pair for model 'fake-model' is in service and "
                                              "reachable: d0 unreachable"}

    for _ in range(4):
        reply = await send(first.url, "/v1/completions", completion(unique_prompt(), max_tokens=2))
        assert reply.status == 502 and error_of(reply)["type"] == "engine_unreachable"
    async def charged() -> bool:  # counted by the supervisor as it drains the workers' reports: a pass later
        return value(scrape(first), "narwhal_engine_failures_total", engine="d0", phase="decode",
                     reason="engine_unreachable") >= 1

    await _until(charged, 5, "d0's charges counted")
    # The same drains would have counted any charge to the producer by now: there is none.
    p0 = await engine_entry(first, "p0")
    assert p0["state"] == "admitted" and p0["failure_streak"] == 0  # the producer is not charged
    after_p0 = sum(value(scrape(first), "narwhal_engine_failures_total", engine="p0", phase=phase, reason=reason)
                   for phase in ("prefill", "decode") for reason in ("engine_unreachable", "engine_disconnect"))
    assert after_p0 == before_p0
    d0 = await engine_entry(first, "d0")
    assert d0["state"] == "degraded" and d0["unreachable"] is True  # never ejected: a role of one
    assert "engine d0 (consumer) charged as consumer: its own decode leg failed: engine_unreachable" \
        in first.log_text()


async def test_a_degraded_consumer_that_recovers_is_probed_back_without_a_client_request(
    first: RouterProcess, fleet: FakeFleet
) -> None:
    fleet.control_request("POST", "/engines/d0/stop")
    for _ in range(3):
        await send(first.url, "/v1/completions", completion(unique_prompt(), max_tokens=2))
    await wait_state(first, "d0", "degraded")
    fleet.control_request("POST", "/engines/d0/start")
    entry = await wait_state(first, "d0", "admitted", timeout=6 * HEALTH_S + 2)  # no request sent meanwhile
    assert entry["failure_streak"] == 0

    async def ready() -> bool:  # a worker's own failed connection lapses within a second
        return (await _ready(first))[0] == 200 and not (await engine_entry(first, "d0"))["unreachable"]

    await _until(ready, 4 * HEALTH_S + 1, "/ready 200 again, d0 reachable")
    assert "engine d0 (consumer): degraded -> admitted: a probe passed: streak cleared" in first.log_text()


async def test_draining_the_last_consumer_is_said_and_named_by_ready_and_the_503(first: RouterProcess) -> None:
    from tests.real_gunicorn.support import admin

    await wait_state(first, "d0", "admitted")
    drained = await admin(first, "POST", "/admin/engines/d0/drain")
    try:
        assert drained["state"] == "draining"
        assert drained["warning"] == ("engine d0 was the last of its role in service for 'fake-model': /ready answers "
                                      "503 and its requests 503 no_engine until an engine of its role is readmitted")
        assert await _ready(first) == (503, {"ready": False, "reason": "no producer->consumer pair for model "
                                                                      "'fake-model' is in service and reachable: "
                                                                      "d0 draining"})
        reply = await send(first.url, "/v1/completions", completion(unique_prompt(), max_tokens=2))
        assert reply.status == 503 and error_of(reply)["type"] == "no_engine"
        assert error_of(reply)["message"].endswith("d0 draining")
    finally:
        readmitted = await admin(first, "POST", "/admin/engines/d0/readmit")
    assert "warning" not in readmitted


def test_narwhal_status_shows_the_engines_and_the_settings_redacted(first: RouterProcess) -> None:
    import subprocess
    import sys

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "narwhal", "status", "--url", first.url, *args],
                              capture_output=True, text=True, timeout=30)

    shown = status("--token", TOKEN, "--settings")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "STATE", "STREAK", "UNREACHABLE", "VERSION", "LOAD", "HOLDINGS"]
    rows = {line.split()[0]: line.split() for line in lines[1:3]}
    assert rows["p0"][1:3] == ["producer", "admitted"] and rows["d0"][1] == "consumer"
    settings = json.loads(shown.stdout.split("\n\n", 1)[1])
    assert settings["server"]["admin_token"] == "<redacted>" and TOKEN not in shown.stdout
    assert settings["recovery"]["max_ejected_fraction"] == 0.5
    refused = status("--token", "wrong")
    assert refused.returncode == 1 and refused.stderr.strip() == (
        "narwhal status: /admin/engines answered 401 (check --token or server.admin_token)")


async def test_an_engine_preflight_found_unreachable_is_shown_so_from_the_start(
    fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Preflight at start said d0 is unreachable: the admin view says so at once (it used to say
    ``unreachable: false`` until the supervisor's first failed read)."""
    from tests.real_gunicorn.support import start_router

    fleet.control_request("POST", "/engines/d0/stop")
    router = start_router(fleet, engines_named("p0", "d0"), tmp_path_factory.mktemp("pre"), wait_ready=False,
                          server={"workers": 1, "admin_token": TOKEN}, preflight={"on_start": True})
    try:
        entry = await engine_entry(router, "d0")
        assert (entry["state"], entry["unreachable"]) == ("ejected", True), entry
        assert (await engine_entry(router, "p0"))["unreachable"] is False
    finally:
        router.stop()
