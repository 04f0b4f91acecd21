"""The passthrough engine choice (docs/behaviour.md "The other P/D endpoints"): consumers first, least loaded, caps,
quarantine soft.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from narwhal.errors import PlacementError
from narwhal.fleet import Engine, Fleet
from narwhal.fleet.passthrough import choose, serving_phase
from narwhal.fleet.placement import Placement
from narwhal.request.slot_wait import WaitingEngine
from narwhal.settings import Settings
from narwhal.shm.local import LocalFleetState

MODEL = "m"


def _fleet(*engines: dict[str, Any]) -> Fleet:
    specs = [{"url": f"http://127.0.0.1:{9000 + i}", "models": [MODEL], **e} for i, e in enumerate(engines)]
    return Fleet(Settings(engines=specs, placement={"queue_timeout_s": 0.2}))


def _single(*engines: dict[str, Any]) -> tuple[WaitingEngine, LocalFleetState, Fleet]:
    fleet = _fleet(*engines)
    state = LocalFleetState(fleet)
    placement = Placement(fleet, state, state, Settings(placement={"queue_timeout_s": 0.2}).placement)
    return WaitingEngine(placement, random.Random(0)), state, fleet


FOUR = ({"name": "p0", "role": "producer"}, {"name": "p1", "role": "producer"},
        {"name": "d0", "role": "consumer"}, {"name": "b0", "role": "both"})


def _names(order: list[Engine]) -> list[str]:
    return [e.name for e in order]


def test_consumers_come_before_producers_whatever_their_load() -> None:
    fleet = _fleet(*FOUR)
    decodes = [0, 0, 50, 40]
    prefills = [0, 0, 0, 0]
    order = choose(fleet.engines, lambda e: True, prefills, decodes, random.Random(1))
    assert _names(order) == ["b0", "d0", "p0", "p1"] or _names(order) == ["b0", "d0", "p1", "p0"]
    assert [serving_phase(e) for e in order] == ["decode", "decode", "prefill", "prefill"]


def test_least_loaded_first_by_the_phase_each_engine_serves() -> None:
    fleet = _fleet(*FOUR)
    # Producers are weighed by prefill counts, consumers by decode counts.
    order = choose(fleet.engines, lambda e: True, [7, 2, 99, 99], [99, 99, 3, 1], random.Random(0))
    assert _names(order) == ["b0", "d0", "p1", "p0"]


def test_ties_are_broken_at_random() -> None:
    fleet = _fleet({"name": "d0", "role": "consumer"}, {"name": "d1", "role": "consumer"})
    firsts = {choose(fleet.engines, lambda e: True, [0, 0], [0, 0], random.Random(seed))[0].name for seed in range(40)}
    assert firsts == {"d0", "d1"}


def test_unusable_and_full_engines_are_left_out() -> None:
    fleet = _fleet({"name": "d0", "role": "consumer", "max_inflight_decode": 2},
                   {"name": "d1", "role": "consumer"}, {"name": "p0", "role": "producer", "max_inflight_prefill": 1})
    order = choose(fleet.engines, lambda e: e.name != "d1", [0, 0, 1], [2, 0, 0], random.Random(0))
    assert order == []
    order = choose(fleet.engines, lambda e: e.name != "d1", [0, 0, 0], [1, 0, 0], random.Random(0))
    assert _names(order) == ["d0", "p0"]


def test_rank_orders_before_load() -> None:
    fleet = _fleet({"name": "d0", "role": "consumer"}, {"name": "d1", "role": "consumer"})
    left = {"d0": 5.0, "d1": 1.0}
    order = choose(fleet.engines, lambda e: True, [0, 0], [0, 9], random.Random(0), lambda e: left[e.name])
    assert _names(order) == ["d1", "d0"]


def test_reserve_holds_the_serving_phase_slot_until_released() -> None:
    single, state, fleet = _single(*FOUR)
    slot = single.try_reserve(MODEL)
    assert slot is not None and slot.engine.name in ("d0", "b0") and slot.phase == "decode"
    assert state.count(slot.engine, "decode") == 1
    other = single.try_reserve(MODEL)
    assert other is not None and other.engine is not slot.engine  # least loaded: the other consumer
    slot.release()
    slot.release()  # idempotent
    assert state.count(slot.engine, "decode") == 0
    other.release()


def test_a_producer_serves_only_when_no_consumer_can() -> None:
    single, state, fleet = _single(*FOUR)
    state.out = {fleet.by_name["d0"].index, fleet.by_name["b0"].index}
    slot = single.try_reserve(MODEL)
    assert slot is not None and slot.engine.role == "producer" and slot.phase == "prefill"
    assert state.count(slot.engine, "prefill") == 1
    slot.release()


def test_quarantined_engines_serve_only_when_nothing_else_can() -> None:
    single, state, fleet = _single({"name": "d0", "role": "consumer"}, {"name": "d1", "role": "consumer"})
    state.quarantine(fleet.by_name["d0"], 30)
    for _ in range(5):
        slot = single.try_reserve(MODEL)
        assert slot is not None and slot.engine.name == "d1"
        slot.release()
    state.quarantine(fleet.by_name["d1"], 60)
    slot = single.try_reserve(MODEL)
    assert slot is not None and slot.engine.name == "d0"  # its quarantine ends first


async def test_reserve_waits_for_a_slot_then_gives_up_with_no_engine() -> None:
    single, state, fleet = _single({"name": "d0", "role": "consumer", "max_inflight_decode": 1})
    loop = asyncio.get_running_loop()
    held = single.try_reserve(MODEL)
    assert held is not None
    loop.call_later(0.05, held.release)
    again = await single.reserve(MODEL, loop.time() + 5)
    assert again.engine.name == "d0"
    with pytest.raises(PlacementError) as caught:
        await single.reserve(MODEL, loop.time() + 5)
    assert caught.value.reason == "no_engine" and "all reservations are in use" in caught.value.message
    again.release()
    state.out = {0}
    with pytest.raises(PlacementError) as caught:
        await single.reserve(MODEL, loop.time() + 5)
    assert "every engine serving it is out" in caught.value.message


def test_reported_load_counts_beside_in_flight() -> None:
    # d0 holds fewer of this host's legs but reports more for others: b0 is the less loaded.
    fleet = _fleet(*FOUR)
    decodes, prefills = [0, 0, 1, 3], [0, 0, 0, 0]
    assert _names(choose(fleet.engines, lambda e: True, prefills, decodes, random.Random(1)))[:2] == ["d0", "b0"]
    extra = [0.0, 0.0, 5.0, 0.0]
    order = choose(fleet.engines, lambda e: True, prefills, decodes, random.Random(1), extra=extra)
    assert _names(order)[:2] == ["b0", "d0"]
