"""The handoffs an attempt leaves undecoded (``narwhal.request.handoff_release``, docs/behaviour.md "Cleanup"),
decided by what the client was sent (``committed``) and whether the decode went out (``sent``),
not by a log: released through a consumer that can pull them, or abandoned, and where a release
goes when a consumer cannot be reached."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY

from narwhal.engines import endpoints
from narwhal.engines.relay import Signal
from narwhal.errors import DeadlineExceeded, EngineClientError, EngineError
from narwhal.request.accesslog import AccessRecord
from narwhal.shm.local import LocalFleetState
from tests.unit.request.attempt_support import (
    DESCRIPTOR,
    Client,
    Engines,
    Leg,
    client_request,
    held,
    setup_attempts,
)


def _handoff_counts() -> tuple[float, float]:
    return tuple(REGISTRY.get_sample_value(f"narwhal_handoffs_{kind}_total") or 0.0  # type: ignore[return-value]
                 for kind in ("released", "abandoned"))


def _delta(before: tuple[float, float]) -> tuple[float, float]:
    now = _handoff_counts()
    return now[0] - before[0], now[1] - before[1]


async def test_an_expired_handoff_is_sent_nowhere_and_counted_abandoned() -> None:
    # older than handoff.max_age_s: the lease may be over (docs/decisions.md "vLLM releases")
    engines = Engines(age_s=10_000.0)
    attempts, state, reports, spawned = setup_attempts(engines)
    before = _handoff_counts()
    with pytest.raises(EngineError) as failed:
        await attempts.run(Client(), client_request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert failed.value.reason == "handoff_expired" and not failed.value.counts and engines.legs == 0
    assert spawned == [] and engines.releases == [] and held(state) == ([0, 0], [0, 0])
    assert _delta(before) == (0, 1)


async def test_an_invalid_handoff_is_sent_nowhere_and_counted_abandoned() -> None:
    engines = Engines(descriptor={"remote_engine_id": ""})
    attempts, _, reports, spawned = setup_attempts(engines)
    before = _handoff_counts()
    with pytest.raises(EngineError) as failed:
        await attempts.run(Client(), client_request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert str(failed.value) == "invalid handoff: missing engine identity" and engines.legs == 0
    assert spawned == [] and engines.releases == [] and reports.seen[0]["reason"] == "invalid_handoff"
    assert _delta(before) == (0, 1)


async def test_a_client_gone_after_the_first_token_releases_no_handoff() -> None:
    engines = Engines(leg=Leg([b"data: t0\n\n", b"data: [DONE]\n\n"]))
    attempts, state, _, spawned = setup_attempts(engines)
    client = Client(leave_on_write=True)
    with pytest.raises(ConnectionResetError):
        await attempts.run(client, client_request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    # Committed: the consumer had the handoff and is decoding it; closing the leg aborts it.
    assert client.committed and spawned == [] and engines.leg is not None and engines.leg.closed
    assert held(state) == ([0, 0], [0, 0])


async def test_a_client_gone_before_the_first_token_has_its_handoff_released() -> None:
    class Gone(Leg):
        async def next_span(self) -> bytes | Signal:
            raise asyncio.CancelledError  # the handler is cancelled while waiting for the token

    engines = Engines(leg=Gone([]))
    attempts, state, _, spawned = setup_attempts(engines)
    with pytest.raises(asyncio.CancelledError):
        await attempts.run(Client(), client_request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert len(spawned) == 1
    await spawned[0]
    assert engines.releases == ["d0"] and held(state) == ([0, 0], [0, 0])


# -- a handoff the consumer never saw (docs/behaviour.md "Cleanup"): released through a consumer that
# can pull it --


async def _run_to_failure(engines: Engines, fault: type[BaseException]) -> tuple[str, list[Any], LocalFleetState]:
    attempts, state, _, spawned = setup_attempts(engines, consumers=2)
    rec = AccessRecord(request_id="c", endpoint="e")
    with pytest.raises(fault):
        await attempts.run(Client(), client_request(), rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert rec.consumer is not None
    return rec.consumer, spawned, state


@pytest.mark.parametrize("reason", ["engine_unreachable", "first_token_timeout"])
async def test_a_decode_whose_connect_failed_is_released_through_another_consumer(reason: str) -> None:
    fault = EngineError("no connect", reason=reason, engine="d?", phase="decode")
    engines = Engines(leg=Leg([], connect_fault=fault))
    before = _handoff_counts()
    chosen, spawned, state = await _run_to_failure(engines, EngineError)
    (task,) = spawned
    await task
    other = "d1" if chosen == "d0" else "d0"
    assert engines.releases == [other]  # the chosen one just failed to connect: the other first
    assert _delta(before) == (1, 0) and held(state) == ([0, 0, 0], [0, 0, 0])


async def test_a_deadline_while_connecting_tries_the_chosen_consumer_first() -> None:
    engines = Engines(leg=Leg([], connect_fault=DeadlineExceeded("the request deadline ran out while decoding")))
    before = _handoff_counts()
    chosen, spawned, _ = await _run_to_failure(engines, DeadlineExceeded)
    engines.unreachable = {chosen}
    await spawned[0]
    other = "d1" if chosen == "d0" else "d0"
    assert engines.releases == [chosen, other] and _delta(before) == (1, 0)


async def test_a_handoff_no_consumer_can_reach_is_abandoned() -> None:
    fault = EngineError("no connect", reason="engine_unreachable", engine="d?", phase="decode")
    engines = Engines(leg=Leg([], connect_fault=fault), unreachable={"d0", "d1"})
    before = _handoff_counts()
    chosen, spawned, _ = await _run_to_failure(engines, EngineError)
    await spawned[0]
    assert engines.releases == ["d1" if chosen == "d0" else "d0", chosen] and _delta(before) == (0, 1)


async def test_a_decode_that_was_sent_then_failed_releases_nothing() -> None:
    # The consumer had the handoff (it may be pulling the blocks): nobody else may pull them too.
    fault = EngineError("boom", reason="engine_5xx", engine="d?", phase="decode")
    engines = Engines(leg=Leg([], fail_at=fault))
    _, spawned, _ = await _run_to_failure(engines, EngineError)
    assert spawned == [] and engines.releases == []


async def test_a_malformed_descriptor_from_an_abandoned_prefill_goes_nowhere() -> None:
    engines = Engines(descriptor={**DESCRIPTOR, "remote_block_ids": [True]})
    attempts, state, _, spawned = setup_attempts(engines, consumers=2)
    resv = attempts.placement.try_place("m")
    assert resv is not None
    before = _handoff_counts()
    rest = engines.prefill(resv.producer, endpoints.COMPLETIONS, {})
    attempts.releases.detach(rest, client_request(), resv)
    await spawned[-1]
    assert engines.releases == [] and _delta(before) == (0, 1) and held(state) == ([0, 0, 0], [0, 0, 0])


async def test_an_abandoned_prefill_releases_its_handoff_to_the_chosen_consumer_holding_no_slot() -> None:
    engines = Engines()
    attempts, state, _, spawned = setup_attempts(engines, consumers=2)
    resv = attempts.placement.try_place("m")
    assert resv is not None
    held_during: list[tuple[list[int], list[int]]] = []
    release = engines.release

    async def watched(*args: Any, **kw: Any) -> str:
        prefill, decode = held(state)
        held_during.append((list(prefill), list(decode)))  # copies: the counts are live lists
        return await release(*args, **kw)

    engines.release = watched  # type: ignore[method-assign]
    rest = engines.prefill(resv.producer, endpoints.COMPLETIONS, {})
    attempts.releases.detach(rest, client_request(), resv)
    await spawned[-1]
    assert engines.releases == [resv.consumer.name] and held_during == [([0, 0, 0], [0, 0, 0])]


async def _refused_by_the_consumer(version: str | None) -> tuple[Engines, list[Any]]:
    """A decode the consumer (of ``version``) answers 400 before any output (docs/decisions.md "vLLM releases" "a
    consumer's refusal").
    """
    refusal = EngineClientError("max_tokens is too large", engine="d0", phase="decode", status=400)
    engines = Engines(leg=Leg([], fail_at=refusal))
    attempts, state, _, spawned = setup_attempts(engines)
    attempts.placement.fleet.set_version(attempts.placement.fleet.by_name["d0"], version)
    with pytest.raises(EngineClientError):
        await attempts.run(Client(), client_request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    for task in spawned:
        await task
    assert held(state) == ([0, 0], [0, 0])
    return engines, spawned


async def test_a_refused_decode_is_released_unless_the_consumers_vllm_frees_it_itself() -> None:
    for version in ("0.11.0", "0.20.2", None):  # no cleanup in these releases, or not known
        engines, spawned = await _refused_by_the_consumer(version)
        assert len(spawned) == 1 and engines.releases == ["d0"], version
    for version in ("0.21.0", "0.33.0"):  # _with_kv_transfer_rejection_cleanup frees it
        engines, spawned = await _refused_by_the_consumer(version)
        assert spawned == [] and engines.releases == [], version
