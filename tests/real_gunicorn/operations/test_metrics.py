"""docs/operations.md "Following a request" metrics after faulty traffic through 2 workers: each counter moves by
exactly what happened.
"""

from __future__ import annotations

import aiohttp

from narwhal.testing.harness import RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    at_rest,
    completion,
    scrape,
    send,
    settled,
    unique_prompt,
    value,
    wait_until,
)


async def test_fault_metrics_count_exactly_what_happened(solo_router: RouterProcess) -> None:
    before = at_rest(solo_router, "narwhal_client_disconnects_total", "narwhal_handoffs_",
                     "narwhal_engine_failures_total", "narwhal_stream_aborted_total", "narwhal_attempts_total",
                     "narwhal_requests_total")
    for fault in ("bad_blocks", "mooncake"):  # two handoffs rejected and sent nowhere
        reply = await send(solo_router.url, "/v1/completions",
                           completion(unique_prompt(), fake={"prefill": {"descriptor": fault}}))
        assert reply.status == 502
    # (a handoff too old to decode is sent nowhere and counted abandoned: test_lease.py, whose fleet's
    # short lease frees its blocks; here they would stay pinned past the module's end)
    # one stream cut by the engine after its first tokens
    reply = await send(solo_router.url, "/v1/completions",
                       completion(unique_prompt(), max_tokens=6, fake={"decode": {"close_after": 2}}))
    assert reply.status == 200
    # one client that leaves mid-stream
    async with aiohttp.ClientSession() as session:
        resp = await session.post(solo_router.url + "/v1/completions",
                                  json=completion(unique_prompt(), max_tokens=100,
                                                  fake={"decode": {"token_delay_s": 0.05}}))
        await resp.content.readany()
        resp.close()

    def delta(name: str, **labels: str) -> float:
        return value(scrape(solo_router), name, **labels) - value(before, name, **labels)

    wait_until(lambda: delta("narwhal_client_disconnects_total") == 1, 5, "the disconnect counted")
    assert delta("narwhal_handoffs_released_total") == 0
    assert delta("narwhal_handoffs_abandoned_total") == 2
    # Counted by the supervisor as it charges (blame decides whom): within a pass or two.
    wait_until(lambda: delta("narwhal_engine_failures_total", engine="p2", phase="prefill",
                             reason="invalid_handoff") == 2, 5, "p2's charges counted")
    wait_until(lambda: delta("narwhal_engine_failures_total", engine="d2", phase="decode",
                             reason="engine_disconnect") == 1, 5, "d2's charge counted")
    assert delta("narwhal_stream_aborted_total", reason="engine_disconnect") == 1
    assert delta("narwhal_stream_aborted_total", reason="client_disconnect") == 1
    assert delta("narwhal_attempts_total", outcome="invalid_handoff") == 2
    # Request counts are written in bulk (narwhal.metric_tally): the other worker's may land a moment later.
    requests = settled(lambda: tuple(delta("narwhal_requests_total", endpoint="/v1/completions", code=code,
                                           model=MODEL) for code in ("502", "499")), (2, 1))
    assert requests == (2, 1)


async def test_the_supervisor_exports_engine_state_and_fleet_wide_inflight(solo_router: RouterProcess) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(solo_router.url + "/v1/completions",
                                  json=completion(unique_prompt(), max_tokens=60,
                                                  fake={"decode": {"token_delay_s": 0.05}}))
        await resp.content.readany()
        wait_until(lambda: value(scrape(solo_router), "narwhal_engine_inflight", engine="d2", phase="decode") == 1,
                   5, "the open stream exported")
        await resp.read()
    text = scrape(solo_router)
    assert value(text, "narwhal_engine_state", engine="p2", role="producer") == 0
    assert 'narwhal_engine_state{engine="d2",role="consumer"} 0.0' in text
    wait_until(lambda: value(scrape(solo_router), "narwhal_engine_inflight", engine="d2", phase="decode") == 0,
               5, "the finished stream exported")
