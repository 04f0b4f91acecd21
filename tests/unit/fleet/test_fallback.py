"""Placement's second look (docs/behaviour.md "Recovery" round 4): unreachable engines last, after ejected ones
that are reachable, which join only in a role's panic (``narwhal.fleet.placement.fallback``)."""

from __future__ import annotations

import pytest

from narwhal.fleet.placement.fallback import reachable_first
from narwhal.supervisor.reachability import Reachability
from tests.unit.fleet.placement_support import KEY, MODEL, Reading, fleet_of, place


def _eject(view, name: str) -> None:  # type: ignore[no-untyped-def]
    view.out.add(name)
    view.ejected.add(name)


def test_a_dead_consumer_does_not_take_traffic_while_an_ejected_reachable_one_is_held_out_by_the_cap() -> None:
    # The minimal case that once answered 502 to every request: d0 ejected for stream faults (reachable), d1 killed
    # (kept in by the cap)
    placement, _, _, _, view = fleet_of(producers=1, consumers=2)
    _eject(view, "d0")
    view.down.add("d1")
    for _ in range(20):
        resv = place(placement)
        assert resv.consumer.name == "d0"
        resv.release()


def test_an_unreachable_consumer_is_avoided_while_an_admitted_one_can_take_the_request() -> None:
    placement, _, _, inflight, view = fleet_of(producers=1, consumers=2)
    view.down.add("d0")
    for _ in range(5):  # d1 gets busier, d0 stays idle: unreachable outweighs load
        assert place(placement).consumer.name == "d1"


def test_ejected_engines_are_not_used_when_a_reachable_placeable_engine_of_the_role_exists() -> None:
    placement, _, _, _, view = fleet_of(producers=1, consumers=3)
    _eject(view, "d0")
    view.down.add("d1")
    view.left["d2"] = 5.0  # quarantined but reachable: tier 0 beats the ejected d0
    assert place(placement).consumer.name == "d2"


def test_operator_ejected_and_draining_engines_never_join_the_fallback() -> None:
    placement, _, _, _, view = fleet_of(producers=1, consumers=2)
    view.out.add("d0")  # out by hand: not in view.ejected
    view.down.add("d1")
    assert place(placement).consumer.name == "d1"  # the dead one, as a last resort


def test_with_every_consumer_out_the_model_has_no_pair() -> None:
    placement, _, _, _, view = fleet_of(producers=1, consumers=2)
    _eject(view, "d0")
    _eject(view, "d1")
    assert placement.try_place(MODEL) is None


def test_an_unreachable_producer_comes_after_an_ejected_reachable_producer() -> None:
    placement, _, _, _, view = fleet_of(producers=2, consumers=1)
    _eject(view, "p0")
    view.down.add("p1")
    assert place(placement).producer.name == "p0"


def test_a_local_decode_falls_back_the_same_way() -> None:
    placement, _, _, _, view = fleet_of(producers=1, consumers=2)
    _eject(view, "d0")
    view.down.add("d1")
    found = placement.try_place(MODEL, local=True)
    assert found is not None and found.consumer.name == "d0"


def test_reachability_follows_the_last_word_and_counts_each_change_once() -> None:
    reach = Reachability()
    reach.reported("p0", "d1", False, "d1", True)
    assert reach.unreachable("d1") and reach.version == 1
    reach.reported("p0", "d1", False, "d1", True)
    assert reach.version == 1  # no change, no new version
    reach.reported("p0", "d0", True, None, False)
    assert reach.unreachable("d1")  # a success elsewhere says nothing of d1
    reach.reported("p0", "d1", False, "d1", False)  # a fault after a connection
    assert not reach.unreachable("d1") and reach.version == 2
    reach.saw("d0", False)
    reach.reported("p0", "d0", True, None, False)
    assert not reach.unreachable("d0")
    assert reach.take_changes() == [("d1", False), ("d1", True), ("d0", False), ("d0", True)]
    assert reach.take_changes() == []


def test_an_engine_that_left_the_fleet_is_forgotten() -> None:
    reach = Reachability()
    reach.saw("d9", False)
    assert reach.names() == ["d9"]
    reach.forget("d9")
    assert reach.names() == [] and not reach.unreachable("d9")


# One order for every fallback (docs/behaviour.md, "Placement"): reachable before unreachable,
# whatever the load, saturation or breaker state. A dead engine's last reading is stale and
# unsaturated, so before the rule it beat a reachable one that was saturated.

def _saturate(readings, clock, *names: str) -> None:  # type: ignore[no-untyped-def]
    readings.set(**{n: Reading(read_at=clock.now, kv_usage=0.97) for n in names})


def test_a_saturated_quarantined_consumer_comes_before_a_dead_one() -> None:
    placement, readings, clock, _, view = fleet_of(producers=1, consumers=2)
    view.left["d0"] = 5.0
    view.down.add("d1")
    _saturate(readings, clock, "d0")
    for _ in range(5):
        resv = place(placement)
        assert resv.consumer.name == "d0"
        resv.release()


@pytest.mark.parametrize("policy", ["least_loaded", "affinity", "held"])
def test_a_saturated_quarantined_producer_comes_before_a_dead_one(policy: str) -> None:
    placement, readings, clock, _, view = fleet_of(producers=2, consumers=1, policy=policy)
    view.left["p0"] = 5.0
    view.down.add("p1")
    _saturate(readings, clock, "p0")
    for _ in range(3):
        resv = place(placement, key=KEY)
        assert resv.producer.name == "p0"
        resv.release()


def test_a_saturated_ejected_consumer_in_a_panic_comes_before_a_dead_one() -> None:
    placement, readings, clock, _, view = fleet_of(producers=1, consumers=2)
    _eject(view, "d0")
    view.down.add("d1")
    _saturate(readings, clock, "d0")
    assert place(placement).consumer.name == "d0"


def test_a_local_decode_takes_a_saturated_reachable_consumer_before_a_dead_one() -> None:
    placement, readings, clock, _, view = fleet_of(producers=1, consumers=2)
    view.left["d0"] = 5.0
    view.down.add("d1")
    _saturate(readings, clock, "d0")
    found = placement.try_place(MODEL, local=True)
    assert found is not None and found.consumer.name == "d0"


def test_the_dead_engine_is_still_the_last_resort() -> None:
    placement, readings, clock, _, view = fleet_of(producers=1, consumers=2)
    view.out.add("d0")  # out by hand
    view.down.add("d1")
    _saturate(readings, clock, "d1")
    assert place(placement).consumer.name == "d1"


def test_reachable_first_keeps_each_group_in_its_order() -> None:
    placement, _, _, _, _ = fleet_of(producers=3, consumers=1)
    p0, p1, p2 = placement.fleet.engines[:3]
    down = [False, True, False, False]
    assert reachable_first([p1, p2, p0], lambda e: e, down) == [[p2, p0], [p1]]
    assert reachable_first([p0, p2], lambda e: e, down) == [[p0, p2]]
    assert reachable_first([p1], lambda e: e, down) == [[p1]]
