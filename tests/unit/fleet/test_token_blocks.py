"""Token block keys (docs/behaviour.md "Placement"): the chain both the supervisor (from an engine's
``BlockStored`` events) and a worker (from the prompt's ids) compute, and the held policy's
placement by them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from narwhal.fleet.placement.held import order
from narwhal.fleet.placement.token_blocks import FOLLOWED_EMPTY, TokenBlocks, as_key, cached_tokens, chain_keys
from narwhal.shm.holdings import Held
from narwhal.supervisor.kv_events.decode import Removed, Stored
from narwhal.supervisor.kv_events.stream import Stream
from tests.unit.fleet.held_support import PRODUCERS, build_held, place_blocks, prompt_blocks, ranked

IDS = list(range(100, 140))  # 40 tokens: 10 blocks of 4


def test_equal_token_prefixes_have_equal_keys_and_a_changed_token_changes_every_key_after_it() -> None:
    keys = [as_key(d) for d in chain_keys(IDS, 4)]
    assert len(keys) == 10 and len(set(keys)) == 10
    assert [as_key(d) for d in chain_keys(IDS[:22], 4)] == keys[:5]  # only full blocks
    changed = [as_key(d) for d in chain_keys(IDS[:9] + [7] + IDS[10:], 4)]
    assert changed[:2] == keys[:2] and not set(changed[2:]) & set(keys)


def test_an_id_that_is_not_a_u32_ends_the_chain_there() -> None:
    assert len(chain_keys([1, 2, 3, 4, 5, -1, 7, 8, 9, 10, 11, 12], 4)) == 1
    assert len(chain_keys([1, 2, 3, 4, 2**40, 6, 7, 8], 4)) == 1


def test_the_supervisor_keys_stored_blocks_as_a_worker_keys_the_prompt() -> None:
    stream = Stream()
    # Blocks 0-3 stored in one event, 4-5 in a second whose parent is block 3's engine hash.
    stream.live(0, b"a", [Stored((11, 12, 13, 14), None, tuple(IDS[:16]), 4)])
    stream.live(1, b"b", [Stored((15, 16), 14, tuple(IDS[16:24]), 4)])
    prompt = TokenBlocks(IDS)
    held = frozenset(stream.keys.values())
    assert prompt.matched(4, held) == 6 and stream.block_size == 4
    stream.live(2, b"c", [Removed((13,))])  # evicted: the prompt's run stops before it
    assert prompt.matched(4, frozenset(stream.keys.values())) == 2


def test_a_block_whose_parent_was_never_seen_has_no_key() -> None:
    stream = Stream()
    stream.live(0, b"a", [Stored((21, 22), 99, tuple(IDS[:8]), 4)])  # parent 99: stored before we joined
    assert set(stream.blocks) == {21, 22} and not stream.keys


def test_predicted_cached_tokens_are_whole_blocks_short_of_the_last_token() -> None:
    assert cached_tokens(10, 4, 40) == 36  # a prompt of exactly 10 blocks: vLLM computes its last token
    assert cached_tokens(10, 4, 43) == 40
    assert cached_tokens(3, 4, 43) == 12
    assert cached_tokens(0, 4, 43) == 0


def _followed(held: Held, keys: list[int], block_tokens: int = 4) -> Held:
    return replace(held, token_keys=frozenset(keys), block_tokens=block_tokens)


def test_a_prompt_with_token_ids_goes_where_the_events_say_its_blocks_are() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    ids = list(range(len(blocks.text) // 4))  # the fake's four characters a token
    holder = ranked(blocks)[-1]
    for i, _ in enumerate(PRODUCERS):
        holdings.set(i, [])
        holdings.held[i] = _followed(holdings.held[i], [])
    held_keys = TokenBlocks(ids).keys(4, 40)
    holdings.held[PRODUCERS.index(holder)] = _followed(holdings.held[PRODUCERS.index(holder)], held_keys)
    blocks.tokens = TokenBlocks(ids)
    found = place_blocks(placement, blocks)
    assert (found.producer.name, found.choice) == (holder, "held")
    assert found.note.predicted_cached_tokens == 160
    assert found.note.predicted_cached_chars == 512  # 160 tokens at 4 characters a token: 2 whole blocks of 256


def test_learned_keys_of_a_followed_producer_are_not_counted_on() -> None:
    placement, holdings, *_ = build_held()
    blocks = prompt_blocks()
    other = ranked(blocks)[-1]
    holdings.set(PRODUCERS.index(other), blocks.keys()[:5])  # learned: it held them once
    for i, _ in enumerate(PRODUCERS):
        if holdings.held[i] is None:
            holdings.set(i, [])
        holdings.held[i] = _followed(holdings.held[i], [], FOLLOWED_EMPTY)  # its events: it holds nothing
    blocks.tokens = TokenBlocks(list(range(len(blocks.text) // 4)))
    found = place_blocks(placement, blocks)
    assert (found.producer.name, found.choice, found.note.predicted_cached_tokens) == (
        ranked(blocks)[0], "rendezvous", 0)
    # Without token ids (a model whose prompt cannot be tokenized) the learned keys still place it.
    placement2, holdings2, *_ = build_held()
    holdings2.held = holdings.held
    found = place_blocks(placement2, prompt_blocks())
    assert (found.producer.name, found.choice, found.note.predicted_cached_tokens) == (other, "held", None)


def test_order_reports_no_token_prediction_where_events_are_not_followed() -> None:
    blocks = prompt_blocks()
    blocks.tokens = TokenBlocks(list(range(100)))
    reading = Held(frozenset(), 0, None, 4.0, None, 0.0, 1)
    _, facts = order([0], blocks, [reading], lambda i: i, lambda i: 0, lambda i: 0.0, lambda i: 0.0, 0.1)
    assert facts[0][3] == -1


def _consumer_holds(keys: int, share: float = 0.9) -> tuple[Any, Any]:
    placement, holdings, *_ = build_held(skip_prefill_share=share)
    blocks = prompt_blocks()
    ids = list(range(len(blocks.text) // 4))
    d0 = len(PRODUCERS)  # the consumer's engine index
    holdings.held[d0] = _followed(Held(frozenset(), 0, None, None, None, 0.0, 0), TokenBlocks(ids).keys(4, keys))
    blocks.tokens = TokenBlocks(ids)
    return place_blocks(placement, blocks), TokenBlocks(ids).count(4)


def test_a_consumer_holding_the_prompt_past_the_share_decodes_it_alone() -> None:
    found, total = _consumer_holds(10_000)
    assert (found.local, found.consumer.name, found.choice) == (True, "d0", "consumer_holds")
    short, _ = _consumer_holds(int(total * 0.8))  # 80 % held, 90 % asked: P/D as usual
    assert not short.local and short.choice != "consumer_holds"
    never, _ = _consumer_holds(10_000, share=0.0)  # 0: never
    assert not never.local
