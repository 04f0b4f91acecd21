"""docs/behaviour.md "Placement" through real gunicorn: a decode slot reserved before its prefill is not yet the
engine's.

Its own fleet. ``qp0`` produces ``fake-model`` for ``qd0`` and ``qd1``; ``qp1`` produces a second
model only ``qd0`` also serves, so requests for it put decode reservations on ``qd0`` and
nowhere else, held as long as their (slow) prefills run. The router reads every engine's
``/metrics`` every 100 ms.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import MODEL, TOKEN, completion, engine_entry, records, send, start_router

SIDE_MODEL = "side-model"
BUSY, IDLE = "qd0", "qd1"
BACKGROUND = 4  # requests qd0 serves for someone else, seen only in its /metrics


@pytest.fixture(scope="module")
def pending_fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(["qp0", "qp1", BUSY, IDLE], args=["--model", MODEL, "--lease-s", "120"])
    fleet.control_request("PUT", "/engines/qp1/faults", {"models": [SIDE_MODEL]})
    fleet.control_request("PUT", f"/engines/{BUSY}/faults", {"models": [MODEL, SIDE_MODEL]})
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def pending_router(pending_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines: list[dict[str, Any]] = [
        {"name": "qp0", "role": "producer", "models": [MODEL]},
        {"name": "qp1", "role": "producer", "models": [SIDE_MODEL]},
        {"name": BUSY, "role": "consumer", "models": [MODEL, SIDE_MODEL]},
        {"name": IDLE, "role": "consumer", "models": [MODEL]},
    ]
    proc = start_router(
        pending_fleet, engines, tmp_path_factory.mktemp("pending"),
        server={"workers": 2, "admin_token": TOKEN},
        engine={"prefill_timeout_s": 15},
        placement={"load_interval_s": 0.1, "load_stale_s": 5, "policy": "least_loaded"},
    )
    yield proc
    proc.stop()


async def _until(router: RouterProcess, name: str, check: Any, what: str, timeout: float = 15) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        entry = await engine_entry(router, name)
        if check(entry):
            return entry
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name}: {what}; last {entry}")


def _slow(prompt: str, model: str, prefill_s: float) -> dict[str, Any]:
    return completion(prompt, model=model, fake={"prefill": {"delay_headers_s": prefill_s}})


async def test_a_consumer_busy_elsewhere_stays_avoided_while_prefills_for_it_run(
    pending_fleet: FakeFleet, pending_router: RouterProcess
) -> None:
    pending_fleet.set_background(BUSY, BACKGROUND, hold_s=60)
    url = pending_router.url
    try:
        await _until(pending_router, BUSY, lambda e: e["load"] is not None and e["load"]["age_s"] < 1
                     and e["load"]["running"] + e["load"]["waiting"] == BACKGROUND, "the background never showed")
        # Four decodes reserved on qd0, their prefills running for a while yet: qd0 has not seen them.
        tag = uuid.uuid4().hex
        side = [asyncio.ensure_future(send(url, "/v1/completions", _slow(f"{tag} side {i}", SIDE_MODEL, 6)))
                for i in range(BACKGROUND)]
        await _until(pending_router, BUSY, lambda e: e["inflight"]["decode"] == BACKGROUND, "side decodes reserved")
        reserved = time.monotonic()
        # A reading taken since: it must not take the reservations for legs qd0 counts.
        await _until(pending_router, BUSY, lambda e: e["load"]["age_s"] < time.monotonic() - reserved - 0.05,
                     "no reading since the reservations")
        # qd0 now holds 4 of ours plus 4 of someone else's; qd1 nothing: 8 requests fit on qd1
        # (its load stays below 8) before qd0 is the lesser.
        main = [asyncio.ensure_future(send(url, "/v1/completions", _slow(f"{tag} main {i}", MODEL, 2)))
                for i in range(8)]
        replies = await asyncio.gather(*main, *side)
        assert [r.status for r in replies] == [200] * 12, [r.raw for r in replies if r.status != 200]
        decoded = {name: len([r for r in records(pending_fleet, name, tag) if "main" in r["body"]["prompt"]])
                   for name in (BUSY, IDLE)}
        assert decoded == {BUSY: 0, IDLE: 8}
    finally:
        pending_fleet.set_background(BUSY, 0)
