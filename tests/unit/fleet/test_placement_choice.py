"""The choice of docs/behaviour.md "Placement", pure: engine-reported load, saturation, prefix affinity, local decode.

Counts are :class:`LocalInflight`, engine reports a :class:`Readings` source, the clock and the
randomness are injected: every test decides exactly what placement sees.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

from narwhal.fleet import Fleet
from narwhal.fleet.placement import LocalInflight, Placement
from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.fleet.placement.load import fresh_loads
from narwhal.settings import Settings
from tests.unit.fleet.placement_support import (
    KEY,
    MODEL,
    PRODUCERS,
    FakeView,
    Reading,
    build,
    fleet_of,
    place,
)


def _consumers(placement: Placement, n: int) -> Counter[str]:
    chosen: Counter[str] = Counter()
    for _ in range(n):
        found = place(placement)
        chosen[found.consumer.name] += 1
        found.release()
    return chosen


def _favourite(key: int, names: list[str]) -> list[str]:
    return rank(names, key, key_hash)


# ------------------------------------------------------------------------------ affinity


def test_the_same_key_goes_to_its_favourite_producer_every_time() -> None:
    placement, *_ = fleet_of()
    favourite = _favourite(KEY, PRODUCERS)[0]
    choices = set()
    for _ in range(20):
        found = place(placement, KEY)
        choices.add((found.producer.name, found.choice))
        found.release()
    assert choices == {(favourite, "affinity")}


def test_the_ranking_is_the_same_in_another_process_with_another_hash_seed() -> None:
    here = _favourite(KEY, PRODUCERS)
    code = (
        "from narwhal.fleet.placement.affinity import key_hash, rank;"
        f"print(','.join(rank({PRODUCERS!r}, key_hash('You are a helpful assistant. ' * 8), key_hash)))"
    )
    for seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().split(",") == here


def test_different_keys_spread_over_the_producers() -> None:
    favourites = Counter(_favourite(key_hash(f"system prompt number {i} " * 4), PRODUCERS)[0] for i in range(200))
    assert set(favourites) == set(PRODUCERS)
    assert min(favourites.values()) >= 20  # ~50 each: no producer is left without prefixes


def test_a_favourite_over_its_bound_overflows_to_the_next_in_rank() -> None:
    placement, _, _, inflight, _ = fleet_of()
    first, second = _favourite(KEY, PRODUCERS)[:2]
    engine = placement.fleet.by_name[first]
    for _ in range(6):  # mean (6/4 = 1.5) × 1.25 + 1 = 2.875 < 6
        assert inflight.try_reserve(engine, "prefill", None)
    found = place(placement, KEY)
    assert (found.producer.name, found.choice) == (second, "affinity_overflow")


def test_a_favourite_within_its_bound_keeps_the_prefix_though_others_are_idler() -> None:
    placement, _, _, inflight, _ = fleet_of()
    favourite = _favourite(KEY, PRODUCERS)[0]
    engine = placement.fleet.by_name[favourite]
    assert inflight.try_reserve(engine, "prefill", None)  # 1 <= 0.25 × 1.25 + 1
    found = place(placement, KEY)
    assert (found.producer.name, found.choice) == (favourite, "affinity")


def test_reported_load_counts_toward_the_bound() -> None:
    placement, readings, clock, _, _ = fleet_of(load_interval_s=0.1)
    first, second = _favourite(KEY, PRODUCERS)[:2]
    readings.set(**{first: Reading(clock.now, running=8, waiting=4)})  # 12 > 3 × 1.25 + 1
    found = place(placement, KEY)
    assert (found.producer.name, found.choice) == (second, "affinity_overflow")


def test_without_a_key_producers_are_least_loaded() -> None:
    placement, readings, clock, _, _ = fleet_of(load_interval_s=0.1)
    readings.set(p0=Reading(clock.now, running=3), p1=Reading(clock.now, running=1),
                 p2=Reading(clock.now, waiting=2), p3=Reading(clock.now, running=0, waiting=0))
    found = place(placement)
    assert (found.producer.name, found.choice) == ("p3", "least_loaded")


def test_the_retry_avoids_the_favourite_that_just_failed() -> None:
    placement, *_ = fleet_of()
    first, second = _favourite(KEY, PRODUCERS)[:2]
    found = place(placement, KEY, avoid=frozenset({first}))
    assert found.producer.name == second  # the next in rank: the prefix's second home


def test_a_capped_favourite_gives_way_and_kv_peers_hold() -> None:
    names = ["p0", "p1"]
    favourite, other = _favourite(KEY, names)
    engines = [
        {"name": favourite, "role": "producer", "max_inflight_prefill": 1, "kv_peers": ["d0"]},
        {"name": other, "role": "producer", "kv_peers": ["d1"]},
        {"name": "d0", "role": "consumer"},
        {"name": "d1", "role": "consumer"},
    ]
    placement, *_ = build(engines)
    held = place(placement, KEY)
    assert (held.producer.name, held.consumer.name) == (favourite, "d0")  # its only peer
    nxt = place(placement, KEY)
    assert (nxt.producer.name, nxt.consumer.name) == (other, "d1")  # favourite at its cap


# ------------------------------------------------------------------------------ consumers, load


def test_consumers_by_in_flight_plus_reported_load() -> None:
    placement, readings, clock, inflight, _ = fleet_of(load_interval_s=0.1)
    d0 = placement.fleet.by_name["d0"]
    assert inflight.try_reserve(d0, "decode", None)  # d0: 1 here + 0 reported
    readings.set(d1=Reading(clock.now, running=2, waiting=1))  # d1: 0 here + 3 reported
    for _ in range(10):
        found = place(placement)
        assert found.consumer.name == "d0"
        found.release()


def test_stale_readings_are_not_used() -> None:
    placement, readings, clock, _, _ = fleet_of(load_interval_s=0.1, load_stale_s=2)
    readings.set(d0=Reading(clock.now, running=50))
    assert _consumers(placement, 5) == Counter({"d1": 5})
    clock.now += 2.5  # the reading is now older than load_stale_s, and nothing newer came
    assert set(_consumers(placement, 40)) == {"d0", "d1"}


def test_this_hosts_own_legs_are_not_counted_twice() -> None:
    placement, readings, clock, inflight, _ = fleet_of(load_interval_s=0.1)
    d0 = placement.fleet.by_name["d0"]
    for _ in range(8):  # 8 of ours on d0, which d0 reports among its running requests
        assert inflight.try_reserve(d0, "decode", None)
    readings.set(d0=Reading(clock.now, running=8, ours=8), d1=Reading(clock.now, running=8, waiting=8))
    # d0: 8 here + (8 - 8) reported from elsewhere; d1: 0 here + 16 from elsewhere.
    assert _consumers(placement, 10) == Counter({"d0": 10})
    loads, _ = fresh_loads([Reading(0.0, running=2, ours=5)], 0.0, 2.0, 0.95)
    assert loads.extra == [0.0]  # legs that ended since the reading: never a negative load


def test_fresh_loads_by_age() -> None:
    loads, until = fresh_loads([Reading(10.0, 1, 2, 0.99), None, Reading(7.0, 5, 5, 0.1)], 11.0, 2.0, 0.95)
    assert loads.extra == [3.0, 0.0, 0.0] and loads.saturated == [True, False, False]
    assert until == 12.0


def test_ties_are_broken_at_random() -> None:
    placement, readings, clock, _, _ = fleet_of(load_interval_s=0.1, seed=7)
    readings.set(d0=Reading(clock.now, running=1), d1=Reading(clock.now, running=1))
    assert set(_consumers(placement, 40)) == {"d0", "d1"}


def test_a_saturated_consumer_is_chosen_only_when_every_one_is() -> None:
    placement, readings, clock, inflight, _ = fleet_of(load_interval_s=0.1)
    readings.set(d0=Reading(clock.now, kv_usage=0.96), d1=Reading(clock.now, running=20, kv_usage=0.5))
    assert _consumers(placement, 5) == Counter({"d1": 5})  # busier, but has KV room
    readings.set(d1=Reading(clock.now, running=20, kv_usage=0.99))
    found = place(placement)
    assert found.consumer.name == "d0"  # both saturated: the least loaded of them


def test_every_producer_saturated_is_the_saturated_choice_and_keeps_the_usual_rule() -> None:
    placement, readings, clock, _, _ = fleet_of(load_interval_s=0.1)
    favourite = _favourite(KEY, PRODUCERS)[0]
    # Saturation no longer tells them apart: the prefix still goes to its favourite (its blocks
    # are cached there: the least new KV), within the load bound.
    readings.set(**{p: Reading(clock.now, running=1, kv_usage=0.97) for p in PRODUCERS})
    found = place(placement, KEY)
    assert (found.producer.name, found.choice) == (favourite, "saturated")
    found.release()
    # The favourite over the bound (mean 3.25: 1.25 * 3.25 + 1 = 5.06 < 10): the least loaded.
    readings.set(**{p: Reading(clock.now, running=10 if p == favourite else 1 + i, kv_usage=0.97)
                    for i, p in enumerate(PRODUCERS)})
    least = min((p for p in PRODUCERS if p != favourite), key=PRODUCERS.index)
    found = place(placement, KEY)
    assert found.producer.name != favourite and found.choice == "saturated"
    without_key = place(placement)
    assert (without_key.producer.name, without_key.choice) == (least, "saturated")


def test_a_saturated_favourite_loses_the_prefix_while_others_have_room() -> None:
    placement, readings, clock, _, _ = fleet_of(load_interval_s=0.1)
    first, second = _favourite(KEY, PRODUCERS)[:2]
    readings.set(**{first: Reading(clock.now, kv_usage=0.99)})
    found = place(placement, KEY)
    assert found.producer.name == second


def test_load_interval_zero_never_reads_reports_and_places_as_before() -> None:
    off, readings, clock, _, _ = fleet_of(load_interval_s=0, prefix_affinity=False, seed=3)
    readings.set(d0=Reading(clock.now, running=99, kv_usage=1.0))
    settings = Settings(engines=[{"name": n, "role": "producer" if n[0] == "p" else "consumer",
                                  "url": f"http://127.0.0.1:{9000 + i}", "models": [MODEL]}
                                 for i, n in enumerate(PRODUCERS + ["d0", "d1"])])
    fleet = Fleet(settings)
    before = Placement(fleet, FakeView(), LocalInflight(len(fleet.engines)), settings.placement, random.Random(3))
    got, expected = [], []
    for _ in range(30):
        a, b = place(off, KEY), place(before)
        got.append((a.producer.name, a.consumer.name))
        expected.append((b.producer.name, b.consumer.name))
    assert got == expected
    assert readings.reads == 0


def test_readings_are_read_once_per_published_round() -> None:
    placement, readings, clock, _, _ = fleet_of(load_interval_s=0.1)
    readings.set(d0=Reading(clock.now))
    for _ in range(10):
        place(placement).release()
    assert readings.reads == 1
    readings.set(d1=Reading(clock.now))
    place(placement).release()
    assert readings.reads == 2


# ------------------------------------------------------------------------------ local decode


def test_a_local_decode_reserves_a_consumer_only() -> None:
    placement, readings, clock, inflight, _ = fleet_of(load_interval_s=0.1)
    readings.set(d0=Reading(clock.now, running=4))
    found = placement.try_place(MODEL, local=True)
    assert found is not None
    assert (found.producer.name, found.consumer.name, found.choice, found.local) == ("d1", "d1", "local", True)
    assert inflight.totals("prefill") == [0] * 6
    assert inflight.totals("decode")[4:] == [0, 1]
    found.release()
    assert inflight.totals("decode") == [0] * 6


def test_a_local_decode_respects_caps_and_avoid() -> None:
    engines = [{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer", "max_inflight_decode": 1},
               {"name": "d1", "role": "consumer"}]
    placement, *_ = build(engines)
    first = placement.try_place(MODEL, frozenset({"d1"}), local=True)
    assert first is not None and first.consumer.name == "d0"
    assert placement.try_place(MODEL, frozenset({"d1"}), local=True) is None  # d0 full, d1 avoided
