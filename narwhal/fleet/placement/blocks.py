"""Prefix block keys (docs/behaviour.md "Placement"): chained 64-bit keys over fixed-size blocks of the prompt text.

The affinity text (docs/behaviour.md "Placement", not cut at ``affinity_chars``) is cut into blocks of
``placement.held.block_chars`` characters, up to ``placement.held.max_prefix_chars``; only full blocks
are keyed (a partial last block is nothing a producer can have cached for another prompt).
Block k's key covers blocks 0..k, so two prompts share key k exactly when their first k+1
blocks are equal, the way vLLM chains its block hashes: a producer can only hold block k of a
prompt if it holds every block before it.

Invariants, and why:

* The same keys in every process and every replica: BLAKE2b (``hashlib``, never Python's
  salted ``hash()``) of the block's UTF-8 bytes, 8-byte digest, with the previous block's
  digest as the salt: the chain costs one C call per block, no concatenation.
* Each key is computed at most once per request, and only as far as someone asks
  (:meth:`PrefixBlocks.key`): a lookup that stops at the first block no producer holds pays
  for the blocks it looked at; the completed prefill's report finishes the rest, off the
  client's critical path.
* A repeated prefix is not hashed again: a :class:`KeyMemo` (one per worker, bounded) maps a
  block's bytes after a given key to its chained key, so a system prompt every request repeats
  costs a dict lookup per batch of blocks (``KeyMemo.runs``), not a BLAKE2b call per block.
  The key is the hash's, hit or miss: the memo changes what a request costs, never what it
  computes.
* Pure: no I/O, no clock, no settings object; the request layer passes the text, sizes and memo.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from narwhal.fleet.placement.token_blocks import TokenBlocks

Answer = tuple[int, int] | None  # (start, end) characters in the prompt text; None: no answer there

_NO_SALT = b""
_FIRST = -1  # the "previous key" of block 0 in a memo entry: no 64-bit key (unsigned) is -1
# A worker's memo: 4,096 blocks (1 MiB of prompt text, ≈2 MiB with the entries; the runs as much again) hold the
# system prompts and chat histories in use; a workload of prompts never repeated clears it often.
MEMO_BLOCKS = 4096


class KeyMemo:
    """Chained keys already computed: (previous block's key, or -1 for block 0; the block's UTF-8)
    → the block's key. At most ``capacity`` entries: a request whose new blocks would pass it
    empties the table first, so a prompt still in use is back after its next request. A prompt
    never seen before pays one lookup and one store per block beside its hashes (about a third
    more than hashing alone); one seen before, a slice and a lookup per block (a third of it).

    ``runs``: each batch :class:`PrefixBlocks` computed at once, (the key before it, its text) →
    its keys, so the same batch of the same prompt again (a repeated system prompt) is one
    lookup, not one per block: about two calls per block fewer. Bounded apart (``capacity``
    blocks), emptied on its own; a run's keys are the blocks' keys whatever the table holds."""

    __slots__ = ("capacity", "table", "runs", "run_blocks")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.table: dict[tuple[int, bytes], int] = {}
        self.runs: dict[tuple[int, str], tuple[int, ...]] = {}
        self.run_blocks = 0  # keys held in ``runs``

    def keep_run(self, prev: int, text: str, keys: list[int]) -> None:
        """Remember one batch's ``keys``: those of the blocks of ``text`` after key ``prev``."""
        if self.run_blocks + len(keys) > self.capacity:
            self.runs.clear()
            self.run_blocks = 0
        self.runs[prev, text] = tuple(keys)
        self.run_blocks += len(keys)


def _utf8_blocks(chunk: str, width: int) -> list[bytes]:
    """``chunk`` (whole blocks of ``width`` characters) as each block's UTF-8 bytes."""
    if chunk.isascii():  # the usual case: one encode, then slices of bytes (a char is a byte)
        data = chunk.encode("ascii")
        return [data[i : i + width] for i in range(0, len(data), width)]
    return [chunk[i : i + width].encode("utf-8", "surrogatepass") for i in range(0, len(chunk), width)]


class PrefixBlocks:
    """The block keys of one prompt, computed lazily, at most once each."""

    __slots__ = ("text", "block_chars", "count", "cut", "computed", "tokens", "answer", "_salt", "_memo")

    def __init__(self, text: str, block_chars: int, max_chars: int, memo: KeyMemo | None = None) -> None:
        self.text = text
        self.block_chars = block_chars
        self.count = min(len(text), max_chars) // block_chars  # full blocks that get a key
        self.cut = len(text) > max_chars  # the text goes on past what is keyed
        self.computed: list[int] = []  # the keys so far, in order: grown in place, read by the lookup
        self.tokens: TokenBlocks | None = None  # the prompt's token ids, where the request path got them
        # Where the prompt's last answer sits in ``text``: (start, end) characters, or a callable
        # of the text's length bound that says so, asked only when needed; None: nowhere. The
        # policy's, unread here.
        self.answer: Answer | Callable[[int], Answer] = None
        self._salt = _NO_SALT  # the last digest, without a memo (with one, the last key says it)
        self._memo = memo

    def key(self, k: int) -> int:
        """Block ``k``'s chained key (0 ≤ k < ``count``); computes the ones before it first.

        Keys are computed a few at a time, doubling (4, 8, 16 …): a lookup walking a held prefix
        block by block pays one slice and encode per batch, not per block, and computes at most
        twice the keys it looks at (at least 4: a few µs for a prompt nobody holds)."""
        keys = self.computed
        if k < len(keys):
            return keys[k]
        self._extend(min(self.count, max(k + 1, 2 * len(keys), 4)))
        return keys[k]

    def keys(self, n: int | None = None) -> list[int]:
        """The first ``n`` keys (all ``count`` of them by default, exactly ``min(n, count)`` of
        them computed on return); the list is shared, not copied. The lookup calls it once per
        batch: the bounds are tests, not ``min`` calls, and the memo's path is taken from here."""
        count = self.count
        if n is None or n > count:
            n = count
        keys = self.computed
        first = len(keys)
        if n > first:
            if self._memo is not None:
                self._extend_memo(n, self._memo, first)
            else:
                self._extend(n)
        return keys

    def _extend(self, n: int) -> None:
        keys, width = self.computed, self.block_chars
        first = len(keys)
        if n <= first:
            return
        if self._memo is not None:
            self._extend_memo(n, self._memo, first)
            return
        chunk = self.text[first * width : n * width]
        salt = self._salt
        blake2b, from_bytes = hashlib.blake2b, int.from_bytes
        if chunk.isascii():  # the usual case: one encode, then slices of bytes (a char is a byte)
            data = memoryview(chunk.encode("ascii"))
            for k in range(n - first):
                salt = blake2b(data[k * width : (k + 1) * width], digest_size=8, salt=salt).digest()
                keys.append(from_bytes(salt, "little"))
        else:
            for k in range(n - first):
                block = chunk[k * width : (k + 1) * width].encode("utf-8", "surrogatepass")
                salt = blake2b(block, digest_size=8, salt=salt).digest()
                keys.append(from_bytes(salt, "little"))
        self._salt = salt

    def _extend_memo(self, n: int, memo: KeyMemo, first: int) -> None:
        """:meth:`_extend` through the memo: the batch's keys at once when this batch of text
        after this key was seen before (``KeyMemo.runs``); else each block's key looked up until
        the first miss, hashed from there (the same bytes and salt as without the memo: the
        block's UTF-8, the previous digest) and stored. Past a miss each probe starts from a key
        just computed, so it is all but never stored: not looked up (a hit missed costs a hash,
        never a key)."""
        keys, width = self.computed, self.block_chars  # ``first``: len(keys), which the caller has
        chunk = self.text[first * width : n * width]
        start = prev = keys[-1] if keys else _FIRST
        run = memo.runs.get((prev, chunk))
        if run is not None:
            keys.extend(run)
            return
        blocks = _utf8_blocks(chunk, width)
        table = memo.table
        at = 0
        for block in blocks:
            key = table.get((prev, block))
            if key is None:
                break
            keys.append(key)
            prev = key
            at += 1
        if at < len(blocks):
            if len(table) + len(blocks) - at > memo.capacity:
                table.clear()
            salt = _NO_SALT if prev == _FIRST else prev.to_bytes(8, "little")
            blake2b, from_bytes = hashlib.blake2b, int.from_bytes
            for block in blocks[at:]:
                salt = blake2b(block, digest_size=8, salt=salt).digest()
                key = from_bytes(salt, "little")
                table[prev, block] = key
                keys.append(key)
                prev = key
        memo.keep_run(start, chunk, keys[first:])

    @property
    def chars(self) -> int:
        """Characters covered by the keyed blocks."""
        return self.count * self.block_chars
