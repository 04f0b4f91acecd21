"""docs/decisions.md "vLLM releases" "the lease", docs/behaviour.md "Cleanup" through real gunicorn: a handoff is
decoded or released
only while younger than ``handoff.max_age_s``, kept below the producers' KV lease. A prefill that
answers after that age gets 504 ``handoff_expired``, its handoff goes nowhere (counted abandoned),
the producer frees the blocks at its lease, and no consumer ever reads them late: the fake counts
0 ``expired_reads``. A fleet of its own, with a short lease, so the test waits it out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    at_rest,
    completion,
    error_of,
    records,
    send,
    start_router,
    unique_prompt,
    value,
    wait_until,
)

LEASE_S = 2.0
COUNTERS = ("narwhal_handoffs_released_total", "narwhal_handoffs_abandoned_total", "narwhal_attempts_total",
            "narwhal_engine_failures_total")


@pytest.fixture(scope="module")
def lease_fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(["lp0", "ld0"], args=["--model", MODEL, "--lease-s", str(LEASE_S), "--block-size", "4"])
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def leased(lease_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "lp0", "role": "producer"}, {"name": "ld0", "role": "consumer"}]
    proc = start_router(lease_fleet, engines, tmp_path_factory.mktemp("lease"),
                        handoff={"max_age_s": 0.6, "lease_s": LEASE_S})
    yield proc
    proc.stop()


async def test_a_handoff_past_max_age_is_sent_nowhere_and_never_read_late(
    leased: RouterProcess, lease_fleet: FakeFleet
) -> None:
    prompt = unique_prompt()
    before = at_rest(leased, *COUNTERS)
    expired = lease_fleet.stats("lp0")["expired_requests"]
    # The prefill answers after 0.9 s: the handoff is older than handoff.max_age_s = 0.6.
    reply = await send(leased.url, "/v1/completions", completion(prompt, fake={"prefill": {"delay_headers_s": 0.9}}))
    assert (reply.status, error_of(reply)["type"]) == (504, "handoff_expired"), reply.raw
    assert reply.headers["x-narwhal-error"] == "handoff_expired"
    after = at_rest(leased, *COUNTERS)
    assert tuple(value(after, n) - value(before, n) for n in COUNTERS[:2]) == (0.0, 1.0)
    outcome = {"outcome": "handoff_expired"}
    assert value(after, COUNTERS[2], **outcome) - value(before, COUNTERS[2], **outcome) == 1.0
    # handoff_expired is nobody's fault: no engine failure
    assert value(after, COUNTERS[3], engine="lp0", phase="prefill", reason="handoff_expired") == 0.0
    # The producer frees the blocks at its lease; nobody read them, before or after.
    wait_until(lambda: lease_fleet.stats("lp0")["held_blocks"] == 0, LEASE_S + 5, "lp0's lease ran out")
    assert lease_fleet.stats("lp0")["expired_requests"] == expired + 1
    assert records(lease_fleet, "ld0", prompt) == []  # no decode, no release
    assert lease_fleet.stats("lp0")["expired_reads"] == 0


async def test_a_consumer_that_took_the_decode_in_time_decodes_it_however_late_its_head(
    leased: RouterProcess, lease_fleet: FakeFleet
) -> None:
    """The handoff's age bounds the decode's connect and send only: a consumer that accepted the
    request at once and sends its head after 1 s (past max_age_s 0.6, within the first token's
    bound) decodes it; queueing is not expiry."""
    prompt = unique_prompt()
    reply = await send(leased.url, "/v1/completions",
                       completion(prompt, max_tokens=3, fake={"decode": {"delay_headers_s": 1.0}}))
    assert reply.status == 200, reply.raw
    assert reply.text == " t0 t1 t2"
    assert lease_fleet.stats("lp0")["expired_reads"] == 0
