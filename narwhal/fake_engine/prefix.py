"""The fake's prefix cache: an LRU of the prompt's KV blocks, keyed by chained block hashes.

What vLLM does (automatic prefix caching, v1 ``kv_cache_utils``): the prompt's tokens are cut into
blocks of ``block_size`` (16) tokens; block *i*'s hash covers its own tokens *and* block *i-1*'s
hash, so a block can only hit when every block before it hit too (the same 16 tokens after a
different prefix are different KV). Only full blocks are cached, and at least one prompt token is
always computed (a fully cached prompt still recomputes its last block, so ``cached_tokens`` stays
below ``prompt_tokens``). Blocks no running request uses stay cached until evicted, least recently
used first.

How the fake does it: a token is 4 characters of the prompt text as the engine sees it
(``prompt_text``: completions' ``prompt``, chat messages' role and text in order), so a block is 64
characters and the hash chain is Python's ``hash`` of (previous hash, slice): per process, which is
all an engine needs. ``lookup`` walks the chain until the first miss and refreshes what hit;
``insert`` records the blocks once the prefill has really computed them (a concurrent request with
the same prefix does not hit blocks still being computed, as in vLLM).

Invariant: the cache never holds more than ``capacity`` blocks, and ``lookup`` answers in tokens,
the unit of vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` counters (which the engine
keeps, so they stay monotonic when the cache is reconfigured). A leaf: no engine, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

CHARS_PER_TOKEN = 4


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    """The prompt as the engine would tokenize it (a stand-in for the chat template)."""
    if chat:
        parts: list[str] = []
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        return " ".join(str(t) for t in (first if isinstance(first, list) else prompt))
    return ""


def text_tokens(text: str) -> int:
    """Tokens of ``text`` at 4 characters a token (at least 1, as an empty prompt still has BOS)."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


class PrefixCache:
    """An LRU of block hashes within ``capacity`` blocks; counts queried and hit tokens."""

    __slots__ = ("capacity", "block_size", "_blocks")

    def __init__(self, capacity: int, block_size: int = 16) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def block_hashes(self, text: str) -> list[int]:
        """The chained hashes of the full blocks of ``text``."""
        width = self.block_size * CHARS_PER_TOKEN
        hashes: list[int] = []
        parent = 0
        for start in range(0, len(text) - width + 1, width):
            parent = hash((parent, text[start : start + width]))
            hashes.append(parent)
        return hashes

    def lookup(self, hashes: list[int], prompt_tokens: int) -> int:
        """Cached tokens of a prompt: the leading run of hits, leaving ≥ 1 token to compute."""
        usable = min(len(hashes), (prompt_tokens - 1) // self.block_size)
        hit = 0
        blocks = self._blocks
        while hit < usable and hashes[hit] in blocks:
            blocks.move_to_end(hashes[hit])
            hit += 1
        return hit * self.block_size

    def insert(self, hashes: list[int]) -> None:
        """The prefill computed these blocks: most recently used now; evict beyond capacity."""
        blocks = self._blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        self.trim()

    def trim(self) -> None:
        """Evict least recently used blocks until within ``capacity`` (also after it shrank)."""
        blocks = self._blocks
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
