"""docs/behaviour.md "Cleanup" through real gunicorn: a handoff whose decode was never sent — the
consumer
refused the connection, or connecting outlasted the first-token timeout or the request's
deadline — is released through another consumer that can pull it, so the producer's blocks are
freed now, not at its lease.

A fleet of its own (``rp0`` → ``rd0``) and a consumer nothing answers at (``rdx``, a
:class:`DeadEngine` on 127.0.0.1: refusing for one router, a connect that hangs for the other).
A refusing consumer is placed only until it is known unreachable (docs/behaviour.md "Recovery", round 4: then it comes
last): that router reads no load and checks no health, so the first refusal is the first word on
it, and the test sends until a request meets it.
``rd0`` serves background load (another replica's requests, which only its ``/metrics`` shows),
so least-loaded placement puts every decode on ``rdx``, deterministically; the release then
finds ``rd0``. Counter deltas are read from baselines at rest, then once at rest again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.testing.harness import DeadEngine, FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import RELEASES
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    at_rest,
    completion,
    engine_entry,
    error_of,
    records,
    send,
    start_router,
    unique_prompt,
    value,
    wait_until,
)

PRODUCER, GOOD, DEAD = "rp0", "rd0", "rdx"
BACKGROUND = 4  # rd0's requests for someone else: its load, while rdx's is 0
FIRST_TOKEN_S = 1.0
COUNTERS = ("narwhal_handoffs_released_total", "narwhal_handoffs_abandoned_total")


@pytest.fixture(scope="module", params=RELEASES, ids=[f"vllm-{r}" for r in RELEASES])
def rel_fleet(request: pytest.FixtureRequest) -> Iterator[FakeFleet]:
    """The module's fleet, of each vLLM release the fake imitates (docs/decisions.md "vLLM releases")."""
    fleet = FakeFleet.start([PRODUCER, GOOD], args=["--model", MODEL, "--lease-s", "60", "--block-size", "4",
                                                    "--vllm-version", request.param])
    try:
        fleet.set_background(GOOD, BACKGROUND, hold_s=60)
        yield fleet
    finally:
        fleet.stop()


@contextlib.contextmanager
def _router(fleet: FakeFleet, tmp: Any, *, refusing: bool) -> Iterator[RouterProcess]:
    # Refusing: no control read may find rdx unreachable before a request does (the module's text).
    quiet = {"load_interval_s": 0} if refusing else {"load_interval_s": 0.1}
    dead = DeadEngine(refusing=refusing)
    engines: list[dict[str, Any]] = [
        {"name": PRODUCER, "role": "producer"},
        {"name": GOOD, "role": "consumer"},
        # Its models configured: nothing answers its /v1/models, yet it must be placeable.
        {"name": DEAD, "role": "consumer", "url": dead.url, "models": [MODEL]},
    ]
    try:
        proc = start_router(fleet, engines, tmp, server={"workers": 2, "admin_token": TOKEN},
                            engine={"first_token_timeout_s": FIRST_TOKEN_S}, placement=quiet,
                            recovery={"health_interval_s": 600})
        try:
            yield proc
        finally:
            proc.stop()
    finally:
        dead.close()


@pytest.fixture(scope="module")
def refusing(rel_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with _router(rel_fleet, tmp_path_factory.mktemp("refusing"), refusing=True) as proc:
        yield proc


@pytest.fixture(scope="module")
def hanging(rel_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with _router(rel_fleet, tmp_path_factory.mktemp("hanging"), refusing=False) as proc:
        yield proc


async def _placed_on_the_dead_consumer(router: RouterProcess) -> None:
    """Wait until the router sees rd0's background load (fresh), so rdx is the least loaded."""
    def busy(load: Any) -> bool:
        return load is not None and load["age_s"] < 1 and load["running"] + load["waiting"] == BACKGROUND

    for _ in range(300):
        if busy((await engine_entry(router, GOOD))["load"]):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{router.url}: rd0's background load never showed")


async def _released_through_the_other_consumer(
    router: RouterProcess, fleet: FakeFleet, body: dict[str, Any], status: int, kind: str,
    headers: dict[str, str] | None = None,
) -> None:
    await _placed_on_the_dead_consumer(router)
    before = at_rest(router, *COUNTERS)
    expired = fleet.stats(PRODUCER)["expired_requests"]
    reply = await send(router.url, "/v1/completions", body, headers=headers)
    assert (reply.status, error_of(reply)["type"]) == (status, kind), reply.raw
    assert reply.headers["x-narwhal-error"] == kind
    # The release: one non-streaming, one-token decode on rd0 carrying rp0's descriptor.
    wait_until(lambda: len(records(fleet, GOOD, body["prompt"])) == 1, 10, "the release reached rd0")
    (release,) = records(fleet, GOOD, body["prompt"])
    assert (release["body"]["stream"], release["body"]["max_tokens"]) == (False, 1)
    assert release["body"]["kv_transfer_params"]["remote_engine_id"] == fleet.stats(PRODUCER)["engine_id"]
    wait_until(lambda: fleet.stats(PRODUCER)["held_requests"] == 0, 10, "rp0's handoff freed")
    assert fleet.stats(PRODUCER)["held_blocks"] == 0
    assert fleet.stats(PRODUCER)["expired_requests"] == expired  # freed by the read, not the lease
    after = at_rest(router, *COUNTERS)
    assert tuple(value(after, name) - value(before, name) for name in COUNTERS) == (1.0, 0.0)


async def test_a_consumer_that_refuses_the_connection(refusing: RouterProcess, rel_fleet: FakeFleet) -> None:
    before = at_rest(refusing, *COUNTERS)
    refused = []
    for _ in range(20):  # in-flight counts tie: random between rd0 and rdx until rdx refuses once
        body = completion(unique_prompt())
        reply = await send(refusing.url, "/v1/completions", body)
        if reply.status != 200:
            assert (reply.status, error_of(reply)["type"]) == (502, "engine_unreachable"), reply.raw
            refused.append(body["prompt"])
    assert 1 <= len(refused) <= 2, "a known-unreachable consumer was placed again"  # at most one per worker
    for prompt in refused:  # each refused handoff: one non-streaming, one-token decode on rd0
        wait_until(lambda p=prompt: len(records(rel_fleet, GOOD, p)) == 1, 10, "the release reached rd0")
        (release,) = records(rel_fleet, GOOD, prompt)
        assert (release["body"]["stream"], release["body"]["max_tokens"]) == (False, 1)
    wait_until(lambda: rel_fleet.stats(PRODUCER)["held_requests"] == 0, 10, "rp0's handoffs freed")
    after = at_rest(refusing, *COUNTERS)
    assert tuple(value(after, name) - value(before, name) for name in COUNTERS) == (len(refused), 0.0)
    assert (await engine_entry(refusing, DEAD))["unreachable"] is True


async def test_a_connect_that_outlasts_the_first_token_timeout(hanging: RouterProcess, rel_fleet: FakeFleet) -> None:
    await _released_through_the_other_consumer(
        hanging, rel_fleet, completion(unique_prompt()), 504, "first_token_timeout")


async def test_a_deadline_that_runs_out_while_connecting(hanging: RouterProcess, rel_fleet: FakeFleet) -> None:
    # A whole answer: bounded by the deadline only (0.6 s, under the first-token timeout). The
    # release tries the chosen consumer first (a deadline says nothing about it), waits out its
    # connect bound there, then finds rd0.
    await _released_through_the_other_consumer(
        hanging, rel_fleet, completion(unique_prompt(), stream=False), 504, "deadline_exceeded",
        headers={"x-narwhal-deadline-s": "0.6"})
