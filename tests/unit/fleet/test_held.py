"""The ``held`` policy (docs/behaviour.md "Placement"), pure: the least estimated time to handoff, near-ties by
rendezvous rank of the prompt's first block key, labels ``held`` / ``rendezvous`` /
``least_loaded``; the clock is the test's (stale load readings are judged by it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.fleet.placement.held import MISS_WEIGHT, matched_blocks, order
from narwhal.shm.holdings import Held
from tests.unit.fleet.held_support import (
    PREFIX,
    PRODUCERS,
    build_held,
    place_blocks,
    prompt_blocks,
    ranked,
)
from tests.unit.fleet.placement_support import MODEL, Reading


def test_nothing_held_anywhere_every_placement_agrees_on_the_rendezvous_favourite() -> None:
    blocks = prompt_blocks()
    for seed in range(5):  # other workers and replicas: other random streams, the same choice
        placement, *_ = build_held(seed)
        found = place_blocks(placement, prompt_blocks())
        assert (found.producer.name, found.choice, found.note.predicted_cached_chars) == (
            ranked(blocks)[0], "rendezvous", 0)


def test_the_producer_holding_the_prefix_wins_and_says_how_much_it_holds() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    other = ranked(blocks)[-1]  # not the one rank alone would pick
    holdings.set(PRODUCERS.index(other), blocks.keys()[:5])
    found = place_blocks(placement, prompt_blocks())
    assert (found.producer.name, found.choice, found.note.predicted_cached_chars) == (other, "held", 5 * 256)


def test_a_holder_with_a_long_queue_loses_to_an_idle_producer_that_hands_off_sooner() -> None:
    placement, holdings, readings, clock, _ = build_held()
    blocks = prompt_blocks()
    holder = ranked(blocks)[-1]
    holdings.set(PRODUCERS.index(holder), blocks.keys()[:2], mean=2000.0)
    # 6 requests there (its own report), each reckoned at the fleet's mean of 2,000 uncached characters.
    readings.set(**{holder: Reading(read_at=clock.now, running=4, waiting=2)})
    found = place_blocks(placement, prompt_blocks())
    assert found.producer.name != holder and found.choice == "least_loaded"


def test_a_slower_producer_is_passed_over_when_nothing_is_held() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    favourite = ranked(blocks)[0]
    for i, name in enumerate(PRODUCERS):
        holdings.set(i, [], rate=100_000.0 if name == favourite else 200_000.0)
    found = place_blocks(placement, prompt_blocks())
    assert found.producer.name == ranked(blocks)[1] and found.choice == "rendezvous"


def test_estimates_within_the_slack_are_ordered_by_rank() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    favourite = ranked(blocks)[0]
    for i, name in enumerate(PRODUCERS):  # the favourite 5 % slower: within the 10 % slack
        holdings.set(i, [], rate=95_000.0 if name == favourite else 100_000.0)
    assert place_blocks(placement, prompt_blocks()).producer.name == favourite
    slack0, holdings0, *_ = build_held(affinity_slack=0.0)
    holdings0.held = holdings.held
    assert place_blocks(slack0, prompt_blocks()).producer.name != favourite


def test_the_lookup_stops_at_the_first_block_nobody_holds() -> None:
    blocks = prompt_blocks()
    held = frozenset(PrefixBlocks(PREFIX, 256, 65536).keys()[:2])
    fresh = prompt_blocks()
    assert matched_blocks(fresh, [held, frozenset()]) == [2, 0]
    assert len(fresh.keys(0)) == 4  # blocks 0, 1 held, block 2 looked at: one batch of 4, nothing beyond
    nobody = prompt_blocks()
    assert matched_blocks(nobody, [frozenset(), frozenset()]) == [0, 0] and len(nobody.keys(0)) == 0
    long = PrefixBlocks(PREFIX * 4, 256, 65536)  # 32 blocks, the first 8 held
    assert matched_blocks(long, [held | frozenset(long.keys(8)), frozenset()]) == [8, 0]
    assert len(long.keys(0)) == 16  # 4, 8, then 16 for block 8: never all 32
    assert blocks.count == 8


def test_saturation_sends_last_only_the_producers_that_would_compute_the_prompt() -> None:
    placement, holdings, readings, clock, _ = build_held()
    blocks = prompt_blocks()
    holder = ranked(blocks)[-1]
    holdings.set(PRODUCERS.index(holder), blocks.keys())
    # A scarce KV is always nearly full: a saturated holder shares its cached blocks and stays first.
    readings.set(**{holder: Reading(read_at=clock.now, kv_usage=0.99)})
    found = place_blocks(placement, prompt_blocks())
    assert (found.producer.name, found.choice) == (holder, "held")
    found.release()
    # A saturated producer that holds nothing of the prompt goes after the unsaturated ones.
    other = prompt_blocks("another tenant's prompt " * 40)
    favourite = ranked(other)[0]
    found = place_blocks(placement, other)
    assert found.producer.name == favourite  # unsaturated: its rank decides
    found.release()
    readings.set(**{favourite: Reading(read_at=clock.now, kv_usage=0.99)})
    found = place_blocks(placement, other)
    assert found.producer.name != favourite and found.choice == "rendezvous"
    found.release()
    readings.set(**{n: Reading(read_at=clock.now, kv_usage=0.99) for n in PRODUCERS})
    found = place_blocks(placement, prompt_blocks())
    assert (found.producer.name, found.choice) == (holder, "saturated")
    clock.now += 10  # the readings went stale: saturation is no longer known
    found.release()
    assert place_blocks(placement, prompt_blocks()).choice == "held"


def test_a_prompt_without_a_full_block_is_placed_by_the_affinity_rule_or_load() -> None:
    placement, *_ = build_held()
    found = placement.try_place(MODEL, frozenset(), None, False)
    assert found is not None and found.choice == "least_loaded" and found.note is None  # nothing to keep


def test_this_hosts_prefills_in_flight_count_by_their_own_uncached_characters() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    holder, second = ranked(blocks)[-1], ranked(blocks)[0]
    holdings.set(PRODUCERS.index(holder), blocks.keys(), mean=3000.0)
    first = place_blocks(placement, prompt_blocks())
    # Held: it computes only the prompt's tail, and that much is now queued there until the leg ends.
    tail = len(blocks.text) - blocks.count * 256
    assert (first.producer.name, first.note.work, first.note.queued_chars) == (holder, tail, 0)
    assert holdings.queued[PRODUCERS.index(holder)] == tail
    # Its own queued legs are cheap hits: a second one still goes there (the fleet's mean of
    # 3,000 characters a request would have sent it away).
    again = place_blocks(placement, prompt_blocks())
    assert (again.producer.name, again.note.queued_chars) == (holder, tail)
    # A real backlog there, over MISS_WEIGHT times the prompt (a miss elsewhere counts its
    # uncached characters that many times): the idle favourite now.
    backlog = int(MISS_WEIGHT * len(blocks.text)) + 1
    holdings.queued[PRODUCERS.index(holder)] = backlog
    assert place_blocks(placement, prompt_blocks()).producer.name == second
    first.release_prefill()
    assert holdings.queued[PRODUCERS.index(holder)] == backlog - tail and first.note.work == 0


def _order_args(items: list[int], reading: Held | None, ours: float, others: float) -> tuple[Any, ...]:
    """held.order's arguments: candidate 0 with ``reading`` and that work, candidate 1 with nothing."""
    return (items, prompt_blocks(), [reading, None], lambda i: i, lambda i: 17 + i,
            lambda i: ours if i == 0 else 0.0, lambda i: others if i == 0 else 0.0, 0.1)


def test_a_lone_candidate_gets_the_facts_it_would_get_beside_one_with_no_holdings() -> None:
    # One candidate skips its estimate and rank (they order nothing); what it records must not move:
    # beside a candidate with no reading (which changes neither the fleet's mean nor this one's facts).
    blocks = prompt_blocks()
    holder = Held(frozenset(blocks.keys()[:3]), 3, None, 4.0, 1e5, 700.0, 1)
    for reading in (holder, Held(frozenset(), 0, 8, None, None, 0.0, 1), None):
        for ours, others in ((0.0, 0.0), (1234.5, 3.0)):
            alone, facts = order(*_order_args([0], reading, ours, others))
            both, pair_facts = order(*_order_args([0, 1], reading, ours, others))
            assert alone == [0] and facts == [pair_facts[both.index(0)]]
    matched = 3 * 256
    assert order(*_order_args([0], holder, 10.0, 2.0))[1] == [(matched, len(blocks.text) - matched, 1410, -1)]


def test_the_policy_reports_each_finished_prefill_with_what_it_reckoned_and_releases_its_work() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    holder = ranked(blocks)[-1]
    holdings.set(PRODUCERS.index(holder), blocks.keys()[:5])
    resv = place_blocks(placement, prompt_blocks())
    assert (resv.producer.name, resv.note.predicted_cached_chars) == (holder, 5 * 256)
    uncached = len(blocks.text) - 5 * 256
    assert holdings.queued[PRODUCERS.index(holder)] == uncached
    result = SimpleNamespace(descriptor={"remote_engine_id": "engine-7"}, prompt_tokens=500, cached_tokens=320,
                             started_at=10.0, finished_at=10.25)
    placement.policy.prefilled(resv, result)
    assert holdings.reports == [(PRODUCERS.index(holder), "engine-7", len(blocks.text), 500, 320, 0.25,
                                 blocks.keys(), 0, 10.25)]
    resv.release()  # the prefill slot back: its uncached characters are no longer queued there
    assert holdings.queued[PRODUCERS.index(holder)] == 0 and resv.note.work == 0
    resv.release()  # idempotent
    assert holdings.queued[PRODUCERS.index(holder)] == 0
