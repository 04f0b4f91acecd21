"""Quarantine steers traffic away but never empties a role (docs/behaviour.md "Recovery"), through real gunicorn.

One producer, two consumers, ``failure_quarantine_s = 30`` (nothing ends during the test), no
retries, breakers that never eject. A consumer is quarantined by a real failure: a stream the
engine closes after its first token, which counts against the consumer at once (docs/behaviour.md "Recovery"), in
the worker that saw it and fleet-wide once the supervisor publishes.
"""

from __future__ import annotations

import orjson

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import engines_named, router_fixture
from tests.real_gunicorn.support import (
    TOKEN,
    completion,
    engine_entry,
    post,
    records,
    sessions_per_worker,
    unique_prompt,
    wait_state,
)

CONSUMERS = ["sd0", "sd1"]
FAULT = {"decode": {"close_after": 1}}  # follows the request: whichever consumer serves it fails


router = router_fixture(
    engines_named("sp1", *CONSUMERS), "sp1 → both consumers, no retry, a failed engine quarantined for 30 s.",
    server={"workers": 2, "admin_token": TOKEN},
    recovery={"max_retries": 0, "failure_quarantine_s": 30.0, "eject_after": 1000},
)


def _served_by(fleet: FakeFleet, prompt: str) -> list[str]:
    return [name for name in CONSUMERS if records(fleet, name, prompt)]


async def test_quarantine_avoids_a_failed_consumer_and_never_takes_the_last_one_out(
    router: RouterProcess, fleet: FakeFleet
) -> None:
    async with sessions_per_worker(router, 2) as sessions:
        first_worker, second_worker = sessions.values()
        # A failure quarantines the consumer that served it.
        prompt = unique_prompt()
        status, raw = await post(first_worker, router, completion(prompt, fake=FAULT))
        assert status == 200 and b'"engine_disconnect"' in raw, raw
        (failed_first,) = _served_by(fleet, prompt)
        (other,) = set(CONSUMERS) - {failed_first}
        await wait_state(router, failed_first, "quarantined", timeout=2)
        # One consumer left: every worker sends everything to it.
        for session in [first_worker, second_worker] * 3:
            prompt = unique_prompt()
            assert (await post(session, router, completion(prompt)))[0] == 200
            assert _served_by(fleet, prompt) == [other]
        # The other fails too: now every consumer is quarantined.
        prompt = unique_prompt()
        status, raw = await post(second_worker, router, completion(prompt, fake=FAULT))
        assert status == 200 and b'"engine_disconnect"' in raw, raw
        assert _served_by(fleet, prompt) == [other]
        later = await wait_state(router, other, "quarantined", timeout=2)
        earlier = await engine_entry(router, failed_first)
        assert earlier["state"] == "quarantined"
        assert earlier["quarantined_until"] < later["quarantined_until"]
        # Clean requests are still served, by the consumer whose quarantine ends first, in
        # both workers (one knows it locally as well as from the supervisor, one only from it).
        for session in [first_worker, second_worker] * 3:
            prompt = unique_prompt()
            status, raw = await post(session, router, completion(prompt))
            assert status == 200, raw
            assert _served_by(fleet, prompt) == [failed_first]
    # Still placeable, so still ready; the quarantines are still on.
    status, body = http_get(router.url + "/ready")
    assert (status, orjson.loads(body)) == (200, {"ready": True})
    assert {(await engine_entry(router, n))["state"] for n in CONSUMERS} == {"quarantined"}
