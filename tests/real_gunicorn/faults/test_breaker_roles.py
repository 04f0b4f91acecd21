"""docs/behaviour.md "Recovery" through real gunicorn: which success resets which streak of an engine of role ``both``.

Its own fleet: ``rb0`` (role ``both``) and ``rp0`` produce, ``rd0`` and ``rd1`` consume (each
with two producers, so a consumer is charged only on evidence against it). ``rb0`` also serves a
second model nobody else serves, so a short prompt for it is decoded locally on ``rb0`` and
nowhere else: the local successes come exactly where the test puts them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    completion,
    engine_entry,
    send,
    start_router,
    unique_prompt,
)

BOTH, PRODUCER, CONSUMERS = "rb0", "rp0", ["rd0", "rd1"]
SHORT_MODEL = "short-model"
LOCAL_CHARS = 40


@pytest.fixture(scope="module")
def roles_fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start([BOTH, PRODUCER, *CONSUMERS], args=["--model", MODEL, "--lease-s", "120"])
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def roles_router(roles_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines: list[dict[str, Any]] = [{"name": BOTH, "role": "both", "models": [MODEL, SHORT_MODEL]},
                                     {"name": PRODUCER, "role": "producer", "models": [MODEL]}]
    engines += [{"name": n, "role": "consumer", "models": [MODEL]} for n in CONSUMERS]
    proc = start_router(
        roles_fleet, engines, tmp_path_factory.mktemp("roles"),
        server={"workers": 2, "admin_token": TOKEN},
        recovery={"eject_after": 3, "readmit_interval_s": 60, "readmit_interval_max_s": 60},
        placement={"local_prefill_chars": LOCAL_CHARS},
    )
    yield proc
    proc.stop()


async def test_a_both_engine_whose_crossed_handoffs_all_fail_is_ejected_despite_local_successes(
    roles_fleet: FakeFleet, roles_router: RouterProcess
) -> None:
    # Every consumer pulling rb0's KV fails; rb0's own decodes (local, same-worker) succeed.
    roles_fleet.control_request("PUT", f"/engines/{BOTH}/faults",
                                {"kv_read_fails": True, "models": [MODEL, SHORT_MODEL]})
    try:
        entry: dict[str, Any] = {}
        for _ in range(60):
            if (entry := await engine_entry(roles_router, BOTH))["state"] == "ejected":
                break
            # A prompt placed as a pair (crossed, and failing, when rb0 produces for rd0 or rd1),
            # then a short one decoded locally on rb0: a success between every two crossed failures.
            await send(roles_router.url, "/v1/completions", completion(unique_prompt(12)))
            short = await send(roles_router.url, "/v1/completions",
                               completion("hi " + unique_prompt(1)[:8], model=SHORT_MODEL))
            # Served, unless rb0 was ejected meanwhile: then no engine serves the short model.
            assert short.status == 200 or (await engine_entry(roles_router, BOTH))["state"] == "ejected", short.raw
        assert entry["state"] == "ejected", entry
        assert (entry["failure_streak"], entry["ejections"]) == (3, 1)
        assert entry["last_failure"]["reason"] == "engine_stream_error"  # the consumer's pull failed in its stream
        for name in [PRODUCER, *CONSUMERS]:  # the consumers only ever failed with rb0: the fault is rb0's
            other = await engine_entry(roles_router, name)
            assert (other["state"], other["failure_streak"]) == ("admitted", 0), other
    finally:
        roles_fleet.control_request("DELETE", f"/engines/{BOTH}/faults")
