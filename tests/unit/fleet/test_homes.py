"""Homes for the live prefixes (``fleet.placement.homes``): deterministic, bounded by room, the
same whatever order the prefixes and producers come in."""

from __future__ import annotations

import random

import pytest

from narwhal.fleet.placement import homes
from narwhal.fleet.placement.affinity import key_hash, rank

NAMES = [f"p{i}" for i in range(4)]
HASHES = [key_hash(n) for n in NAMES]


def _prefixes(n: int, size: int = 15) -> list[tuple[int, int]]:
    return [(key_hash(f"prefix {i}"), size) for i in range(n)]


def test_a_prefix_with_room_everywhere_is_homed_on_its_rendezvous_favourite() -> None:
    (key, size), = _prefixes(1)
    chosen = homes.assign([(key, size)], [(h, 36) for h in HASHES])
    assert NAMES[chosen[key]] == rank(NAMES, key, key_hash)[0]


def test_room_bounds_each_producer_and_a_prefix_without_room_has_no_home() -> None:
    prefixes = _prefixes(9)
    chosen = homes.assign(prefixes, [(h, 36) for h in HASHES])  # two of 15 blocks each
    per = [sum(1 for at in chosen.values() if at == i) for i in range(4)]
    assert per == [2, 2, 2, 2] and len(chosen) == 8
    assert homes.assign(prefixes, [(h, 0) for h in HASHES]) == {}  # unknown capacity: no room


def test_every_replica_computes_the_same_homes_whatever_order_it_saw_them_in() -> None:
    prefixes = _prefixes(8)
    rooms = [(h, 36) for h in HASHES]
    first = homes.assign(prefixes, rooms)
    shuffled = prefixes[:]
    random.Random(3).shuffle(shuffled)
    assert homes.assign(shuffled, rooms) == first


def test_room_is_the_known_capacity_less_the_margin() -> None:
    assert homes.room_blocks(None) == 0
    assert homes.room_blocks(40) == int(40 * homes.FILL)


def test_past_max_homes_the_longest_prefixes_are_homed() -> None:
    many = [(key_hash(f"short {i}"), 1) for i in range(homes.MAX_HOMES)] + [(key_hash("long"), 10)]
    chosen = homes.assign(many, [(h, 10**6) for h in HASHES])
    assert len(chosen) == homes.MAX_HOMES and key_hash("long") in chosen


def test_rate_classes_are_halvings_of_the_fastest_with_edges_below_each() -> None:
    fastest = 1000.0
    assert [homes.rate_class(r, fastest) for r in (1000, 800, 650, 640, 300, 250, 240, 10)] == [
        1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert homes.rate_class(500, fastest) == 0.5  # a half-rate producer at rest: inside its class
    assert homes.rate_class(None, fastest) == homes.rate_class(400, None) == 1.0  # unknown: unscaled
    assert homes.room_blocks(40, 0.5) == int(40 * homes.FILL * 0.5) and homes.room_blocks(None, 0.5) == 0


def _rooms(rates: list[float | None], capacity: int = 40) -> tuple[list[tuple[int, int]], list[int]]:
    """Each producer's (name hash, KV room) and its room at its rate class, as the supervisor gives them."""
    known = [r for r in rates if r is not None]
    fastest = max(known) if known else None
    kv = [(h, homes.room_blocks(capacity)) for h in HASHES]
    return kv, [homes.room_blocks(capacity, homes.rate_class(r, fastest)) for r in rates]


def _per(chosen: dict[int, int]) -> list[int]:
    return [sum(1 for at in chosen.values() if at == i) for i in range(4)]


def test_a_slower_class_sheds_homes_to_producers_with_room_and_every_replica_agrees() -> None:
    prefixes = _prefixes(6)  # 6 prefixes of 15 on 4 rooms of 36: room to spare
    replicas = []
    # Two replicas whose reads of the engines differ a little: the same classes, the same homes.
    for rates in ([1000.0, 980.0, 1010.0, 470.0], [990.0, 1000.0, 1005.0, 520.0]):
        kv, scaled = _rooms(list(rates))
        replicas.append(homes.assign(prefixes if not replicas else list(reversed(prefixes)), kv, scaled))
    assert _per(replicas[0])[3] <= 1, replicas[0]  # the slow one's 18 blocks take one prefix of 15
    assert len(replicas[0]) == 6 and replicas[0] == replicas[1]
    unscaled = homes.assign(prefixes, *_rooms([None] * 4))
    moved = [k for k in unscaled if unscaled[k] != replicas[0][k]]
    assert all(unscaled[k] == 3 for k in moved)  # only what the slow one shed moved


def test_with_no_spare_room_a_slower_class_keeps_its_homes_so_replicas_agree_whatever_rate_they_read() -> None:
    prefixes = _prefixes(8)  # 8 of 15 on 4 rooms of 36: every room full, none takes another
    full = homes.assign(prefixes, *_rooms([None] * 4))  # a replica that has no rate reported yet
    assert _per(full) == [2, 2, 2, 2]
    slow = homes.assign(prefixes, *_rooms([1000.0, 980.0, 1010.0, 470.0]))  # one that sees p3 at half
    assert slow == full  # no prefix left without a home, none moved: a homeless one is placed by
    # each replica's own holdings, and the two then keep a copy each
    assert homes.assign(prefixes, *_rooms([1000.0, 980.0, 1010.0, 200.0])) == full  # a quarter: the same


def test_kept_ranks_score_only_new_prefixes_and_give_the_same_homes(monkeypatch: pytest.MonkeyPatch) -> None:
    """4,096 prefixes over 32 producers were ranked from scratch every 0.1 s
    on the supervisor's loop (131,072 scores, 60-75 ms). Kept ranks score a prefix once while the
    producers stay; the homes are the ones a fresh assignment gives."""
    rng = random.Random(7)
    producers = [(homes.key_hash(f"p{i}"), 3000) for i in range(32)]
    prefixes = [(rng.getrandbits(63), rng.randint(1, 40)) for _ in range(4096)]
    calls = 0
    real = homes.score

    def counted(key: int, engine: int) -> int:
        nonlocal calls
        calls += 1
        return real(key, engine)

    monkeypatch.setattr(homes, "score", counted)
    ranks = homes.Ranks()
    first = homes.assign(prefixes, producers, [3000] * 32, ranks)
    assert calls == 4096 * 32
    calls = 0
    assert homes.assign(prefixes, producers, [3000] * 32, ranks) == first and calls == 0
    churned = prefixes[:4000] + [(rng.getrandbits(63), 5) for _ in range(96)]
    assert homes.assign(churned, producers, [3000] * 32, ranks) == homes.assign(churned, producers, [3000] * 32)
    assert calls == 96 * 32 + 4096 * 32  # the new ones, then the fresh assignment compared with
    calls = 0
    fewer = producers[:31]  # a producer gone: every rank is scored again
    assert homes.assign(churned, fewer, [3000] * 31, ranks) == homes.assign(churned, fewer, [3000] * 31)
    assert calls == 2 * 4096 * 31
