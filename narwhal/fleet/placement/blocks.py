"""Prefix block keys (SPEC §3.3): chained 64-bit keys over fixed-size blocks of the prompt text.

The affinity text (SPEC §3.2, not cut at ``affinity_chars``) is cut into blocks of
``placement.block_chars`` characters, up to ``placement.max_prefix_chars``; only full blocks
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
* Pure: no I/O, no clock, no settings object; the request layer passes the text and sizes.
"""

from __future__ import annotations

import hashlib

_NO_SALT = b""


class PrefixBlocks:
    """The block keys of one prompt, computed lazily, at most once each."""

    __slots__ = ("text", "block_chars", "count", "cut", "_keys", "_salt")

    def __init__(self, text: str, block_chars: int, max_chars: int) -> None:
        self.text = text
        self.block_chars = block_chars
        self.count = min(len(text), max_chars) // block_chars  # full blocks that get a key
        self.cut = len(text) > max_chars  # the text goes on past what is keyed
        self._keys: list[int] = []
        self._salt = _NO_SALT

    def key(self, k: int) -> int:
        """Block ``k``'s chained key (0 ≤ k < ``count``); computes the ones before it first.

        Keys are computed a few at a time, doubling (4, 8, 16 …): a lookup walking a held prefix
        block by block pays one slice and encode per batch, not per block, and computes at most
        twice the keys it looks at (at least 4: a few µs for a prompt nobody holds)."""
        keys = self._keys
        if k < len(keys):
            return keys[k]
        self._extend(min(self.count, max(k + 1, 2 * len(keys), 4)))
        return keys[k]

    def keys(self, n: int | None = None) -> list[int]:
        """The first ``n`` keys (all ``count`` of them by default); the list is shared, not copied."""
        self._extend(self.count if n is None else min(n, self.count))
        return self._keys

    def _extend(self, n: int) -> None:
        keys, width = self._keys, self.block_chars
        first = len(keys)
        if n <= first:
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

    @property
    def chars(self) -> int:
        """Characters covered by the keyed blocks."""
        return self.count * self.block_chars
