"""A dead engine never absorbs a role's traffic (docs/behaviour.md "Recovery", round 4), through real
gunicorn: a consumer ejected for stream faults (reachable), the other one stopped (refusing every
connection) and kept in by ``max_ejected_fraction``. Before the fix every request went to the
dead one and answered 502 ``engine_unreachable`` while the live one was held out."""

from __future__ import annotations

import asyncio

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import engines_named, faults_cleared_after_each, router_fixture
from tests.real_gunicorn.support import (
    TOKEN,
    completion,
    engine_entry,
    readmit_all,
    send,
    unique_prompt,
)

CONSUMERS = ["sd0", "sd1"]

clean_faults = faults_cleared_after_each("sp0", *CONSUMERS)

capped = router_fixture(
    engines_named("sp0", *CONSUMERS), "sp0 → sd0, sd1; at most half the consumers ejected; 1 s quarantine; "
    "readmission probes far off.",
    server={"workers": 2, "admin_token": TOKEN},
    recovery={"eject_after": 2, "max_ejected_fraction": 0.5, "failure_quarantine_s": 1.0,
              "readmit_interval_s": 60, "readmit_interval_max_s": 60},
)


async def test_a_dead_consumer_does_not_take_the_traffic_while_the_other_is_ejected_but_reachable(
    capped: RouterProcess, fleet: FakeFleet
) -> None:
    await readmit_all(capped, ["sp0", *CONSUMERS])
    fleet.control_request("PUT", "/engines/sd0/faults", {"decode": {"close_after": 1}})
    deadline = asyncio.get_running_loop().time() + 15
    while (await engine_entry(capped, "sd0"))["state"] != "ejected":  # quarantined 1 s after each fault
        assert asyncio.get_running_loop().time() < deadline, "sd0 was never ejected"
        await send(capped.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
    fleet.control_request("DELETE", "/engines/sd0/faults")  # healed; its probe is a minute away
    fleet.control_request("POST", "/engines/sd1/stop")  # refuses every connection from now on

    statuses = []
    for _ in range(40):
        reply = await send(capped.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
        statuses.append(reply.status)
    # At most one request per worker meets the dead consumer before it is known unreachable.
    assert statuses.count(200) >= 38, statuses
    assert set(statuses) <= {200, 502}
    entry = await engine_entry(capped, "sd1")
    assert entry["unreachable"] is True
    assert (await engine_entry(capped, "sd0"))["unreachable"] is False
    log = capped.log_text()
    assert "-> ejected: 2 failure(s) in a row, last engine_disconnect; ejection 1" in log
    assert "engine sd1: unreachable (its last connection attempt failed)" in log

    fleet.control_request("POST", "/engines/sd1/start")
    # Its /metrics answer again, then its /version is read again (docs/decisions.md "vLLM releases": maybe a new
    # release)
    # and the workers take that up: reachable within a few load reads, usually under 1 s. The
    # bound is 20 s: in 2 of about 25 full-suite runs it took over 10 s (not understood yet: the
    # log below says what the supervisor saw when it fails).
    deadline = asyncio.get_running_loop().time() + 20
    while (entry := await engine_entry(capped, "sd1"))["unreachable"]:
        assert asyncio.get_running_loop().time() < deadline, (entry, capped.log_text()[-4000:])
        await asyncio.sleep(0.05)
