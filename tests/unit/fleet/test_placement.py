"""Placement's pure decision (docs/behaviour.md "Placement", "Recovery"): out is hard, quarantine is soft.

A fake view says which engines are out and how long each quarantine has left; counts are
:class:`LocalInflight`. The last tests check the two real views (shared memory and local)
answer the same four questions the same way.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any

import pytest

from narwhal.errors import PlacementError
from narwhal.fleet import Fleet
from narwhal.fleet.placement import LocalInflight, Placement, Reservation
from narwhal.request.slot_wait import WaitingPlacement
from narwhal.settings import Settings
from narwhal.shm.local import LocalFleetState
from narwhal.shm.records import EngineRecord, write_record
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.shm.worker import WorkerFleetState
from tests.unit.fleet.placement_support import MODEL, FakeView


def _settings(*engines: dict[str, Any]) -> Settings:
    specs = [{"url": f"http://127.0.0.1:{9000 + i}", "models": [MODEL], **e} for i, e in enumerate(engines)]
    return Settings(engines=specs)


def _placement(*engines: dict[str, Any], seed: int = 0) -> tuple[WaitingPlacement, FakeView, LocalInflight]:
    settings = _settings(*engines)
    fleet = Fleet(settings)
    view, inflight = FakeView(), LocalInflight(len(fleet.engines))
    return WaitingPlacement(fleet, view, inflight, settings.placement, random.Random(seed)), view, inflight


def _two_by_two(**consumer: Any) -> tuple[WaitingPlacement, FakeView, LocalInflight]:
    return _placement({"name": "p0", "role": "producer"}, {"name": "p1", "role": "producer"},
                      {"name": "d0", "role": "consumer", **consumer}, {"name": "d1", "role": "consumer", **consumer})


def _pair(found: Reservation | None) -> tuple[str, str] | None:
    return None if found is None else (found.producer.name, found.consumer.name)


def _consumers_chosen(placement: Placement, n: int = 40, avoid: frozenset[str] = frozenset()) -> Counter[str]:
    chosen: Counter[str] = Counter()
    for _ in range(n):
        found = placement.try_place(MODEL, avoid)
        assert found is not None
        chosen[found.consumer.name] += 1
        found.release()
    return chosen


def test_nothing_quarantined_asks_nothing_beyond_admitted() -> None:
    placement, view, _ = _two_by_two()
    assert set(_consumers_chosen(placement)) == {"d0", "d1"}  # least loaded, ties at random
    assert view.calls == Counter()  # the hot path: no second pass, no quarantine lookups


def test_every_consumer_quarantined_the_one_whose_quarantine_ends_first_serves() -> None:
    placement, view, _ = _two_by_two()
    view.left = {"d0": 5.0, "d1": 2.0}
    assert _consumers_chosen(placement) == Counter({"d1": 40})
    view.left = {"d0": 0.5, "d1": 2.0}  # a later failure moved d1's end past d0's
    assert _consumers_chosen(placement) == Counter({"d0": 40})


def test_one_consumer_not_quarantined_takes_all_the_traffic() -> None:
    placement, view, _ = _two_by_two()
    view.left = {"d0": 0.1}
    assert _consumers_chosen(placement) == Counter({"d1": 40})


def test_a_producer_not_quarantined_is_preferred_when_consumers_force_the_fallback() -> None:
    placement, view, _ = _two_by_two()
    view.left = {"p0": 0.1, "d0": 3.0, "d1": 4.0}
    for _ in range(20):
        found = placement.try_place(MODEL)
        assert _pair(found) == ("p1", "d0")
        assert found is not None
        found.release()


def test_out_is_hard_quarantine_is_not() -> None:
    placement, view, _ = _two_by_two()
    view.out = {"d1"}
    view.left = {"d0": 9.0}
    assert _consumers_chosen(placement, 5) == Counter({"d0": 5})
    assert placement.has_pair(MODEL)  # only quarantined consumers left: still placeable, so ready
    view.out = {"d0", "d1"}
    assert placement.try_place(MODEL) is None
    assert not placement.has_pair(MODEL)


def test_a_non_quarantined_consumer_at_its_cap_lets_a_quarantined_one_serve() -> None:
    placement, view, inflight = _two_by_two(max_inflight_decode=1)
    view.left = {"d0": 3.0}
    first = placement.try_place(MODEL)
    assert first is not None and first.consumer.name == "d1"
    second = placement.try_place(MODEL)  # d1 is full: the quarantined d0 can take it
    assert second is not None and second.consumer.name == "d0"
    assert placement.try_place(MODEL) is None  # both caps held: nothing, quarantine or not
    assert inflight.totals("decode")[2:] == [1, 1]
    second.release()
    first.release()
    assert inflight.totals("decode") == [0, 0, 0, 0]


def test_the_earliest_ending_quarantined_consumer_at_its_cap_gives_way_to_the_next() -> None:
    placement, view, _ = _two_by_two(max_inflight_decode=1)
    view.left = {"d0": 5.0, "d1": 2.0}
    held = placement.try_place(MODEL)
    assert held is not None and held.consumer.name == "d1"
    nxt = placement.try_place(MODEL)
    assert nxt is not None and nxt.consumer.name == "d0"


def test_kv_peers_hold_in_the_fallback() -> None:
    placement, view, _ = _placement(
        {"name": "p0", "role": "producer", "kv_peers": ["d0"]},
        {"name": "p1", "role": "producer", "kv_peers": ["d1"]},
        {"name": "d0", "role": "consumer"}, {"name": "d1", "role": "consumer"},
    )
    view.left = {"d1": 4.0}
    assert _pair(placement.try_place(MODEL)) == ("p0", "d0")  # d1 quarantined: p1 cannot hand off
    view.out, view.left = {"p1"}, {"d0": 8.0, "d1": 1.0}
    # d1's quarantine ends first, but p0 may only hand off to d0.
    assert _pair(placement.try_place(MODEL)) == ("p0", "d0")


def test_a_retry_avoids_the_engine_that_failed_while_another_quarantined_one_exists() -> None:
    placement, view, _ = _two_by_two()
    view.left = {"d0": 5.0, "d1": 2.0}
    assert _consumers_chosen(placement, 10, avoid=frozenset({"d1"})) == Counter({"d0": 10})


async def test_a_retry_that_must_avoid_every_consumer_still_gets_the_earliest_ending_one() -> None:
    placement, view, _ = _two_by_two()
    view.left = {"d0": 5.0, "d1": 2.0}
    found = await placement.reserve(MODEL, time.monotonic() + 5, avoid=frozenset({"d0", "d1"}))
    assert found.consumer.name == "d1"


async def test_reserve_refuses_at_once_only_when_every_pair_is_out() -> None:
    placement, view, _ = _two_by_two()
    view.out = {"p0", "p1"}
    view.left = {"d0": 1.0}
    with pytest.raises(PlacementError, match="is in service and reachable: p0 out of service, p1 out of service"):
        await placement.reserve(MODEL, time.monotonic() + 5)


# -- the real views -----------------------------------------------------------------------------


def _fleet() -> Fleet:
    return Fleet(_settings({"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"},
                           {"name": "d1", "role": "consumer"}))


def _publish(shared: SharedFleet, fleet: Fleet, name: str, state: int, until: float | None) -> None:
    engine = fleet.by_name[name]
    write_record(shared.region, engine.index, EngineRecord(
        version=shared.generation + 1, state=state, failure_streak=1, ejections=0, quarantined_until=until,
        last_failure_reason=None, last_failure_at=None, name_hash=record_hash(name, engine.url)))
    shared.bump_generation()


def test_the_shared_memory_view_keeps_published_and_local_quarantine_soft() -> None:
    fleet = _fleet()
    shared = SharedFleet.create(engines=len(fleet.engines), slots=2)
    try:
        shared.assign_engines([(e.name, e.url) for e in fleet.engines])
        view = WorkerFleetState(shared, 0, fleet)
        p0, d0, d1 = (fleet.by_name[n] for n in ("p0", "d0", "d1"))
        assert not view.any_avoided() and view.quarantine_left(d0) == 0.0
        _publish(shared, fleet, "d0", 1, time.time() + 20)  # QUARANTINED by the supervisor
        _publish(shared, fleet, "p0", 2, None)  # EJECTED
        assert view.any_avoided()
        assert (view.admitted(d0), view.placeable(d0)) == (False, True)
        assert (view.admitted(p0), view.placeable(p0)) == (False, False)
        assert 19 < view.quarantine_left(d0) <= 20
        view.quarantine(d1, 3.0)  # this worker saw d1 fail
        assert (view.admitted(d1), view.placeable(d1)) == (False, True)
        assert 2 < view.quarantine_left(d1) <= 3
        view.quarantine(d0, 30.0)  # the later of local and published ends it
        assert 29 < view.quarantine_left(d0) <= 30
    finally:
        shared.close()


def test_the_local_view_keeps_quarantine_soft_and_forgets_it_once_over() -> None:
    fleet = _fleet()
    view = LocalFleetState(fleet)
    d0, d1 = fleet.by_name["d0"], fleet.by_name["d1"]
    view.out.add(d1.index)
    view.quarantine(d0, 0.05)
    assert (view.admitted(d0), view.placeable(d0), view.any_avoided()) == (False, True, True)
    assert 0 < view.quarantine_left(d0) <= 0.05
    assert not view.placeable(d1)
    deadline = time.monotonic() + 2
    while not view.admitted(d0):
        assert time.monotonic() < deadline, "the quarantine never ended"
        time.sleep(0.01)
    assert not view.any_avoided() and view.quarantine_left(d0) == 0.0


def test_a_pairs_decode_slot_is_unseen_by_its_consumer_until_the_leg_is_sent() -> None:
    # The load reader takes out of an engine's report only the legs the engine can have counted.
    settings = _settings({"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"})
    fleet = Fleet(settings)
    shared = SharedFleet.create(engines=len(fleet.engines), slots=2)
    try:
        shared.assign_engines([(e.name, e.url) for e in fleet.engines])
        slot = shared.claim_slot(os.getpid())
        assert slot is not None
        view = WorkerFleetState(shared, slot, fleet)
        placement = Placement(fleet, view, view, settings.placement, random.Random(0))
        seen = lambda: [shared.engine_seen(e.index) for e in fleet.engines]  # noqa: E731
        pair = placement.try_place(MODEL)
        assert pair is not None and shared.totals(2) == [1, 0, 0, 1]  # both slots held
        assert seen() == [1, 0]  # the prefill is under way; d0 has not seen the decode yet
        pair.release_prefill()
        pair.decode_sent()
        assert seen() == [0, 1]
        pair.release()
        assert seen() == [0, 0] and shared.totals(2) == [0, 0, 0, 0]
        local = placement.try_place(MODEL, local=True)  # no prefill: its leg goes out at once
        assert local is not None and seen() == [0, 1]
        local.release()
        unsent = placement.try_place(MODEL)  # released before the decode was ever sent
        assert unsent is not None
        unsent.release()
        assert seen() == [0, 0] and shared.totals(2) == [0, 0, 0, 0]
    finally:
        shared.close()
