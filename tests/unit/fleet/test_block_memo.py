"""The worker's memo of block keys (``blocks.KeyMemo``): the same keys as hashing, fewer hashes.

docs/behaviour.md "Placement" wants the same keys in every process and replica, so a memo may change what a
request costs and never what it computes: each test compares with a ``PrefixBlocks`` without
one, and counts the BLAKE2b calls the memo saved."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from narwhal.fleet.placement import blocks as blocks_module
from narwhal.fleet.placement.blocks import KeyMemo, PrefixBlocks

SENTENCE = "You are a careful assistant: answer briefly, never guess, cite. "  # 64 characters
SYSTEM = (SENTENCE * 63)[:4000]  # 15 whole blocks of 256, each the same text (4 sentences)


_BLAKE2B = hashlib.blake2b


class _CountingBlake:
    """``hashlib.blake2b``, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return _BLAKE2B(*args, **kwargs)


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> _CountingBlake:
    counter = _CountingBlake()
    monkeypatch.setattr(blocks_module.hashlib, "blake2b", counter)
    return counter


def _plain(text: str, max_chars: int = 65536) -> list[int]:
    return PrefixBlocks(text, 256, max_chars).keys()


@pytest.mark.parametrize("text", [
    SYSTEM + "\nuser\nhello",
    "é∂" * 700,  # non-ASCII: UTF-8 blocks of 256 characters
    "\ud800" * 600,  # a lone surrogate, as without the memo (surrogatepass)
    SYSTEM[:255],  # no whole block
])
def test_keys_with_a_memo_are_the_hashes_keys(text: str) -> None:
    memo = KeyMemo(4096)
    assert PrefixBlocks(text, 256, 65536, memo).keys() == _plain(text)
    assert PrefixBlocks(text, 256, 65536, memo).keys() == _plain(text)  # from the memo this time


def test_a_repeated_prompt_is_not_hashed_again(hashes: _CountingBlake) -> None:
    memo = KeyMemo(4096)
    first = PrefixBlocks(SYSTEM, 256, 65536, memo).keys()
    assert hashes.calls == 15
    again = PrefixBlocks(SYSTEM, 256, 65536, memo)
    assert again.key(0) == first[0] and again.keys() == first
    assert hashes.calls == 15


def test_a_shared_prefix_hashes_only_the_blocks_after_it(hashes: _CountingBlake) -> None:
    memo = KeyMemo(4096)
    PrefixBlocks(SYSTEM + "\nuser\nfirst question " * 20, 256, 65536, memo).keys()
    other = SYSTEM + "\nuser\nanother one " * 20
    expected = _plain(other)
    before = hashes.calls
    assert PrefixBlocks(other, 256, 65536, memo).keys() == expected
    # Blocks 0..14 are the system prompt's (15 of them); block 15 onwards differ.
    assert hashes.calls - before == len(expected) - 15


def test_the_same_block_text_after_another_prefix_is_another_key() -> None:
    memo = KeyMemo(4096)
    keys = PrefixBlocks(SYSTEM, 256, 65536, memo).keys()
    # Every block's text is the same; each key is another (the chain covers the blocks before it).
    assert SYSTEM[:256] == SYSTEM[1280:1536] and len(set(keys)) == 15
    assert PrefixBlocks(SYSTEM[1280:], 256, 65536, memo).key(0) == keys[0]


def test_lazy_batches_through_the_memo_give_the_same_keys() -> None:
    memo = KeyMemo(4096)
    text = SYSTEM * 3
    warm = PrefixBlocks(text, 256, 65536, memo)
    assert warm.key(0) == _plain(text)[0] and len(warm.keys(1)) == 4  # a batch of 4, as without
    lazy = PrefixBlocks(text, 256, 65536, memo)  # 4 of its keys in the memo, the rest not
    assert [lazy.key(k) for k in (0, 3, 4, 9)] == [_plain(text)[k] for k in (0, 3, 4, 9)]
    assert lazy.keys() == _plain(text)
    assert PrefixBlocks(text, 256, 1000, memo).keys() == _plain(text, 1000)  # max_prefix_chars still cuts


def test_the_memo_stays_within_its_capacity_and_starts_over_when_full(hashes: _CountingBlake) -> None:
    memo = KeyMemo(20)
    PrefixBlocks(SYSTEM, 256, 65536, memo).keys()
    assert len(memo.table) == 15
    other = "x" + SYSTEM
    assert PrefixBlocks(other, 256, 65536, memo).keys() == _plain(other)
    assert len(memo.table) == 15  # 15 more would pass 20: emptied first, then the new prompt's
    calls = hashes.calls
    PrefixBlocks(other, 256, 65536, memo).keys()
    assert hashes.calls == calls  # the prompt in use is held
    PrefixBlocks(SYSTEM, 256, 65536, memo).keys()
    assert hashes.calls == calls + 15  # the one before was let go


def test_a_repeated_batch_is_read_from_the_runs_in_one_lookup(hashes: _CountingBlake) -> None:
    memo = KeyMemo(4096)
    text = SYSTEM + "\nuser\nhello"
    warm = PrefixBlocks(text, 256, 65536, memo)
    warm.key(0)
    warm.keys()
    assert set(memo.runs) == {(-1, text[:1024]), (warm.keys()[3], text[1024:3840])}  # the two batches
    memo.table.clear()  # the runs alone now: no block lookup can answer
    expected = _plain(text)
    calls = hashes.calls
    again = PrefixBlocks(text, 256, 65536, memo)
    assert again.key(0) == expected[0] and again.keys() == expected
    assert hashes.calls == calls and memo.table == {}


def test_the_runs_stay_within_the_capacity_too() -> None:
    memo = KeyMemo(20)
    for prefix in ("a", "b", "c"):
        text = prefix + SYSTEM
        assert PrefixBlocks(text, 256, 65536, memo).keys() == _plain(text)
        assert memo.run_blocks == sum(map(len, memo.runs.values())) <= 20
    assert list(memo.runs) == [(-1, "c" + SYSTEM[:3839])]  # the last prompt's one batch of 15
