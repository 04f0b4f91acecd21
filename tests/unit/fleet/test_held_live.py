"""The ``held`` policy's round-3 decisions, pure, on the test's clock: eviction charged by live
(hot) blocks, a prefix's home reckoned as holding it, a saturated home still a candidate, other
replicas' requests at the producer's own mean, a slower producer's estimate scaled by its rate."""

from __future__ import annotations

from narwhal.fleet.placement.held import EVICT_WEIGHT, evicted_chars
from narwhal.shm.holdings import Held
from tests.unit.fleet.held_support import PRODUCERS, build_held, place_blocks, prompt_blocks, ranked
from tests.unit.fleet.placement_support import Reading

CAPACITY = 40  # blocks of 256 characters: two 8-block prefixes and more fit


def _held(keys: list[int], *, hot: int = 0, capacity: int | None = CAPACITY, rate: float | None = None,
          mean: float = 0.0, homes: dict[int, int] | None = None) -> Held:
    return Held(frozenset(keys), len(keys), capacity, 4.0, rate, mean, 1, hot, homes)


def _filler(n: int, base: int) -> list[int]:
    """``n`` block keys of other prompts (none of this test's prompt)."""
    return [base + i for i in range(n)]


def test_evicted_chars_counts_only_new_blocks_beyond_the_cold_ones_room() -> None:
    full_of_live = _held(_filler(40, 10**6), hot=36)
    # 8 new blocks, 4 of room beside the 36 live ones: 4 live blocks evicted.
    assert evicted_chars(full_of_live, 8 * 256, 256) == 4 * 256 * EVICT_WEIGHT
    assert evicted_chars(_held(_filler(40, 10**6), hot=0), 8 * 256, 256) == 0.0  # stale: free to fill
    assert evicted_chars(full_of_live, 0, 256) == 0.0  # a full hit adds nothing
    assert evicted_chars(None, 8 * 256, 256) == 0.0  # nothing known held
    # Unknown capacity: as large as what it is seen to hold (40), so the same 4.
    assert evicted_chars(_held(_filler(40, 10**6), hot=36, capacity=None), 8 * 256, 256) == 4 * 256 * EVICT_WEIGHT


def test_a_new_prefix_goes_where_the_cache_is_full_of_stale_blocks_not_live_ones() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    live, stale = ranked(blocks)[0], ranked(blocks)[1]  # rank prefers the live one
    for i, name in enumerate(PRODUCERS):
        holdings.held[i] = _held(_filler(40, 10**6 * (i + 1)), hot=40 if name != stale else 0)
    found = place_blocks(placement, prompt_blocks())
    assert (found.producer.name, found.choice, found.note.predicted_cached_chars) == (stale, "rendezvous", 0)
    assert live != stale


def test_a_prefix_nobody_holds_goes_to_its_home_over_the_rendezvous_favourite() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    home = ranked(blocks)[-1]
    for i, name in enumerate(PRODUCERS):
        holdings.held[i] = _held([], homes={blocks.key(0): blocks.count} if name == home else None)
    found = place_blocks(placement, prompt_blocks())
    # Reckoned held for the estimate; what it predicts stays what is known (nothing).
    assert (found.producer.name, found.note.predicted_cached_chars, found.choice) == (home, 0, "rendezvous")


def test_the_home_beats_a_copy_this_replica_keeps_elsewhere() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    copy, home = ranked(blocks)[0], ranked(blocks)[-1]
    for i, name in enumerate(PRODUCERS):
        keys = blocks.keys() if name == copy else []
        holdings.held[i] = _held(keys, homes={blocks.key(0): blocks.count} if name == home else None)
    assert place_blocks(placement, prompt_blocks()).producer.name == home


def test_a_saturated_home_stays_a_candidate_where_saturated_strangers_go_last() -> None:
    placement, holdings, readings, clock, _ = build_held()
    blocks = prompt_blocks()
    home = ranked(blocks)[-1]
    for i, name in enumerate(PRODUCERS):
        holdings.held[i] = _held([], homes={blocks.key(0): blocks.count} if name == home else None)
    full = {name: Reading(clock.now, kv_usage=0.99 if name == home else 0.2) for name in PRODUCERS}
    readings.set(**full)
    assert place_blocks(placement, prompt_blocks()).producer.name == home
    # Not its home: a saturated producer that holds none of the prompt goes last.
    holdings.held[PRODUCERS.index(home)] = _held([])
    assert place_blocks(placement, prompt_blocks()).producer.name != home


def test_other_replicas_requests_count_at_that_producers_own_mean_uncached_characters() -> None:
    placement, holdings, readings, clock, _ = build_held()
    blocks = prompt_blocks()
    hits, misses = ranked(blocks)[1], ranked(blocks)[0]
    # Two requests not ours on every producer: cheap hits on one, misses on the rank favourite,
    # 4,000 characters each elsewhere (the fleet's mean would make them all alike).
    for i, name in enumerate(PRODUCERS):
        holdings.held[i] = _held([], mean={hits: 50.0, misses: 2000.0}.get(name, 4000.0))
    readings.set(**{name: Reading(clock.now, running=2.0) for name in PRODUCERS})
    found = place_blocks(placement, prompt_blocks())
    assert (found.producer.name, found.note.queued_chars) == (hits, 100)


def test_a_producer_at_half_the_rate_loses_a_new_prefix_its_rank_would_give_it() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    slow = ranked(blocks)[0]
    for i, name in enumerate(PRODUCERS):
        holdings.held[i] = _held([], rate=100_000.0 if name == slow else 200_000.0)
    found = place_blocks(placement, prompt_blocks())
    # Twice the estimate is beyond the slack: the rank-second, a fast one, takes it.
    assert found.producer.name == ranked(blocks)[1]
