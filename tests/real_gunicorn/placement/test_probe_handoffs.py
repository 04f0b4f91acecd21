"""Probe handoffs follow the request path's rules (docs/behaviour.md "Recovery").

A consumer probed back in (``hd0``, down when the router started; ``hd1`` keeps the router
ready) is fed a handoff by a producer whose prefill is slower than ``handoff.max_age_s``: the
probe's decode is never sent (a late read could take blocks the producer gave to another
request), the probe cannot decide (the producer's fault, not the consumer's), and the handoff
is counted abandoned. Once the producer is quick again, the next probe readmits the consumer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet
from tests.real_gunicorn.placement.test_upgrade_probes import _admitted_within
from tests.real_gunicorn.support import MODEL, TOKEN, engine_entry, scrape, start_router, wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def slow_producer() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(["hp0", "hd0", "hd1"], args=["--model", MODEL, "--lease-s", "60"])
    yield fleet
    fleet.stop()


def _abandoned(text: str) -> float:
    match = re.search(r"^narwhal_handoffs_abandoned_total ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_a_probe_never_decodes_a_handoff_past_its_age(
    slow_producer: FakeFleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    fleet = slow_producer
    fleet.control_request("POST", "/engines/hd0/stop")  # down at the start: it starts ejected
    router = start_router(
        fleet, [{"name": "hp0", "role": "producer"}, {"name": "hd0", "role": "consumer"},
                {"name": "hd1", "role": "consumer"}],
        tmp_path_factory.mktemp("probe-age"), server={"workers": 2, "admin_token": TOKEN},
        preflight={"on_start": True}, handoff={"max_age_s": 0.4},
        recovery={"eject_after": 2, "readmit_interval_s": 0.5, "readmit_interval_max_s": 0.5},
        engine_contract={"model": MODEL},
    )
    try:
        fleet.control_request("PUT", "/engines/hp0/faults", {"prefill": {"delay_headers_s": 0.8}})
        fleet.control_request("POST", "/engines/hd0/start")
        # Probes run every 0.5 s; each prefill takes 0.8 s, twice the handoff's age bound.
        wait_until(lambda: any("narwhal probe" in str(r["body"]) for r in fleet.control_request(
            "GET", "/engines/hp0/requests")["requests"] if r["phase"] == "prefill"), 15, "a probe's prefill")
        wait_until(lambda: _abandoned(scrape(router)) >= 2, 15, "probe handoffs counted abandoned")
        assert (await engine_entry(router, "hd0"))["state"] in ("ejected", "probing")
        decodes = [r for r in fleet.control_request("GET", "/engines/hd0/requests")["requests"]
                   if r["body"].get("kv_transfer_params")]
        assert decodes == []  # never a late read
        fleet.control_request("DELETE", "/engines/hp0/faults")
        # One look that shows it admitted is the pass: two looks may reach two workers, and the
        # second may not have followed the models generation yet.
        await _admitted_within(router, "hd0", 15)
    finally:
        router.stop()
