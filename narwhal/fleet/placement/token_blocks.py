"""Token block keys (docs/behaviour.md "Placement", "KV-cache events"): the keys by which a prompt's
token blocks are compared with the blocks an engine's KV-cache events say it holds.

An engine's ``BlockStored`` event carries each block's token ids and its parent; its block hash
depends on the engine's ``--prefix-caching-hash-algo``, on ``PYTHONHASHSEED`` (random per process
for ``xxhash``), on LoRA paths the event leaves out. So Narwhal keys both sides with a chain of
its own over the token ids alone: block k's key is BLAKE2b (8-byte digest) of block k's ids as
little-endian u32, salted with block k−1's digest, exactly as the prompt's character blocks are
keyed (``blocks``). The supervisor keys each stored block from its tokens and its parent's key
(a map from the engine's hash to ours, which removals are looked up in); a worker keys the
prompt's ids. Two equal token prefixes of equal block size have equal keys, whatever the engine
hashes with: the dual key llm-d, SMG and Dynamo keep too.

Invariants, and why:

* Pure: no I/O, no clock; the same keys in every process and every router replica.
* A token id that is not a u32 (an untrusted engine's) makes that block and every one after it
  unkeyable (:class:`Unkeyable`), never an exception elsewhere: its blocks match nothing.
* Each key is computed once per request and only as far as a lookup asks (:meth:`TokenBlocks.key`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DEFAULT_CHARS_PER_TOKEN = 4.0  # until a producer's answers say otherwise (English text, roughly)
# A followed engine's block size before it stored any block: its events are followed, it holds
# nothing (the holdings region's u32 "none").
FOLLOWED_EMPTY = 0xFFFFFFFF
ROOT = b"narwhal-token-blocks"  # the salt of block 0 (BLAKE2b takes at most 16 bytes of salt)
_ROOT_SALT = hashlib.blake2b(ROOT, digest_size=8).digest()


class Unkeyable(ValueError):
    """A block whose token ids are not u32 values."""


def digest(previous: bytes | None, ids: Sequence[int]) -> bytes:
    """The 8-byte digest of one block of ``ids`` after the block whose digest is ``previous``
    (None: the first block). :class:`Unkeyable` when an id is not a u32."""
    try:
        data = array("I", ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise Unkeyable(str(exc)) from None
    return hashlib.blake2b(data, digest_size=8, salt=_ROOT_SALT if previous is None else previous).digest()


def as_key(block_digest: bytes) -> int:
    """The 64-bit key of a block's digest (what the holdings region stores)."""
    return int.from_bytes(block_digest, "little")


def chain_keys(ids: Sequence[int], block_size: int, previous: bytes | None = None,
               limit: int | None = None) -> list[bytes]:
    """The digests of the full blocks of ``ids`` after ``previous``, at most ``limit``; stops
    before the first unkeyable block."""
    out: list[bytes] = []
    count = len(ids) // block_size if block_size > 0 else 0
    if limit is not None and count > limit:
        count = limit
    for i in range(count):
        try:
            previous = digest(previous, ids[i * block_size : (i + 1) * block_size])
        except Unkeyable:
            break
        out.append(previous)
    return out


class TokenBlocks:
    """A prompt's token ids as placement compares them: keys per block size, computed lazily
    (engines of one fleet nearly always share one block size; each size asked is keyed apart)."""

    __slots__ = ("ids", "_digests")

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = ids
        self._digests: dict[int, list[bytes]] = {}

    def count(self, block_size: int) -> int:
        """Full blocks of ``block_size`` tokens in the prompt."""
        return len(self.ids) // block_size if block_size > 0 else 0

    def keys(self, block_size: int, n: int) -> list[int]:
        """The first ``n`` block keys (fewer where the prompt or its keyable ids end)."""
        done = self._digests.setdefault(block_size, [])
        if len(done) < n:
            start = len(done)
            done.extend(chain_keys(self.ids[start * block_size :], block_size, done[-1] if done else None,
                                   n - start))
        return [as_key(d) for d in done[:n]]

    def matched(self, block_size: int, held: frozenset[int]) -> int:
        """How many of the prompt's leading blocks ``held`` holds (stops at the first it does not)."""
        total = self.count(block_size)
        run, asked = 0, 0
        keys: list[int] = []
        while run < total:
            if run == asked:  # the next batch: 8, then doubling
                asked = min(max(8, 2 * run), total)
                keys = self.keys(block_size, asked)
                if len(keys) <= run:
                    break  # an unkeyable block: nothing past it can match
            if keys[run] not in held:
                break
            run += 1
        return run


def cached_tokens(run: int, block_size: int, prompt_tokens: int) -> int:
    """The tokens vLLM will report cached for a prompt of ``prompt_tokens`` whose first ``run``
    blocks it holds: whole blocks, at most ``prompt_tokens - 1`` (its scheduler always computes
    the last token: ``max_cache_hit_length``)."""
    if block_size <= 0 or prompt_tokens <= 0:
        return 0
    return min(run, (prompt_tokens - 1) // block_size) * block_size
