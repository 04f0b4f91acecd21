"""The fake's prefix cache: vLLM's block pool, keyed by chained block hashes.

What vLLM does (automatic prefix caching, v1 ``kv_cache_utils`` and ``block_pool``): the prompt's
tokens are cut into blocks of ``block_size`` (16) tokens; block *i*'s hash covers its own tokens
*and* block *i-1*'s hash, so a block can only hit when every block before it hit too (the same 16
tokens after a different prefix are different KV). Only full blocks are cached, and at least one
prompt token is always computed (a fully cached prompt still recomputes its last block, so
``cached_tokens`` stays below ``prompt_tokens``). Every block has a reference count: the running
requests that use it. A cached block is used once however many requests share it. When its
count drops to 0 it joins the *free queue* and keeps its hash. A request's blocks are freed tail
first, so a prompt's tail is evicted before its prefix. A new allocation takes the free queue's
head, evicting that block's hash. So eviction is least recently *freed* first, and never touches
a block that a running request uses. A hit on a free block takes it out of the queue.

How the fake does it: a token is 4 characters of the prompt text as the engine sees it
(``prompt_text``, per endpoint; its id :func:`piece_ids`, what the fake's ``/tokenize`` answers),
so a block is 64 characters, and the hash chain is vLLM's own (``kv_events.chain``: sha256 over
the parent's digest and the block's ids), carried as its low 64 bits, so a KV event names a block
as a real engine would. ``acquire`` takes
a running request's blocks (its prompt's full blocks, computed or not), ``lookup`` walks the
chain until the first miss, ``insert`` records the blocks once the prefill has computed them (a
concurrent request with the same prefix does not hit blocks still being computed, as in vLLM),
and ``release`` gives them back. ``trim`` evicts the free queue's head while the pool (blocks in
use here + ``others``, the running prompts' partial tails, which carry no hash) plus the free
cached blocks exceeds ``capacity``. Held handoff blocks do not count: in vLLM they *are* the
prefill's cached blocks (pinned until read), so counting them apart would count them twice; the
fake leaves them evictable, a difference that lasts only until the consumer's read.

Invariant: free cached blocks + blocks in use ≤ ``capacity`` after every ``trim`` (unless the blocks
in use alone exceed it); a block in use is never evicted; ``lookup`` answers in tokens, the unit of
vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` counters. A leaf: no engine, no I/O.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any

from narwhal.fake_engine.kv_events import Cleared, Event, KvEventPublisher, Removed, Stored, chain, event_hash

CHARS_PER_TOKEN = 4
VOCABULARY = 50_000
_MAX_PENDING = 65536  # blocks hashed, not yet cached: what an insert publishes (parent, tokens)


def piece_ids(text: str) -> list[int]:
    """The fake's token ids of ``text``: one per 4-character piece (a deterministic id each)."""
    return [zlib.crc32(text[i : i + CHARS_PER_TOKEN].encode()) % VOCABULARY
            for i in range(0, len(text), CHARS_PER_TOKEN)]


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _roles_text(head: str, items: Any) -> str:
    parts = [f"system\n{head}\n"] if head else []
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict):
            parts.append(f"{item.get('role')}\n{_content_text(item.get('content'))}\n")
    return "".join(parts)


def prompt_text(body: dict[str, Any], chat: bool, kind: str = "") -> str:
    """The prompt as the engine would tokenize it (a stand-in for the chat template)."""
    if chat:
        return _roles_text("", body.get("messages"))
    if kind == "messages":
        return _roles_text(_content_text(body.get("system")), body.get("messages"))
    if kind == "responses":
        items = body.get("input")
        instructions = _content_text(body.get("instructions"))
        return instructions + items if isinstance(items, str) else _roles_text(instructions, items)
    if kind == "generate":
        ids = body.get("token_ids")
        return " ".join(map(str, ids)) if isinstance(ids, list) else ""
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
    """vLLM's block pool within ``capacity`` blocks: cached hashes, reference counts, free queue."""

    __slots__ = ("capacity", "block_size", "_cached", "_free", "_refs", "_pending", "_seed", "publisher")

    def __init__(self, capacity: int, block_size: int = 16, seed: bytes = b"",
                 publisher: KvEventPublisher | None = None) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._cached: set[int] = set()  # computed blocks, in use or free
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unused: least recently freed first
        self._refs: dict[int, int] = {}  # blocks running requests use, by hash: how many use each
        self._pending: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hashed: (parent, ids) until cached
        self._seed = seed  # the first block's parent digest (kv_events.none_hash)
        self.publisher = publisher  # its events' publisher, when the engine publishes them

    def __len__(self) -> int:
        return len(self._cached)

    @property
    def in_use(self) -> int:
        """Hashed blocks that running requests use: each once, however many share it."""
        return len(self._refs)

    def block_hashes(self, text: str) -> list[int]:
        """The chained hashes of the full blocks of ``text`` (vLLM's chain, low 64 bits)."""
        hashes: list[int] = []
        pending = self._pending
        if len(pending) > _MAX_PENDING:
            pending.clear()
        parent: int | None = None
        for digest, block in chain(piece_ids(text), self.block_size, self._seed):
            h = event_hash(digest)
            if h not in self._cached:
                pending[h] = (parent, block)
            hashes.append(h)
            parent = h
        return hashes

    def acquire(self, hashes: list[int]) -> None:
        """A running request uses these blocks: none of them can be evicted until ``release``."""
        refs, free = self._refs, self._free
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
            free.pop(h, None)

    def release(self, hashes: list[int]) -> None:
        """The request ended: blocks nobody uses join the free queue, its tail first."""
        refs, free, cached = self._refs, self._free, self._cached
        for h in reversed(hashes):
            left = refs[h] - 1
            if left:
                refs[h] = left
                continue
            del refs[h]
            if h in cached:
                free[h] = None

    def lookup(self, hashes: list[int], prompt_tokens: int) -> int:
        """Cached tokens of a prompt: the leading run of hits, leaving ≥ 1 token to compute."""
        usable = min(len(hashes), (prompt_tokens - 1) // self.block_size)
        hit = 0
        cached = self._cached
        while hit < usable and hashes[hit] in cached:
            hit += 1
        return hit * self.block_size

    def insert(self, hashes: list[int], others: int = 0) -> None:
        """The prefill computed these blocks; a block no request holds is freed at once. The
        newly cached ones are one step's ``BlockStored`` (a run per gap), published with the
        evictions the insert caused."""
        refs, free = self._refs, self._free
        events: list[Event] = []
        run: Stored | None = None
        for h in hashes:
            if h not in self._cached:
                self._cached.add(h)
                if h not in refs:
                    free[h] = None
                parent, block = self._pending.pop(h, (None, ()))
                if run is not None and run.hashes[-1] == parent:
                    run.hashes.append(h)
                    run.tokens.extend(block)
                else:
                    run = Stored([h], parent, list(block))
                    events.append(run)
            else:
                run = None
        self.trim(others, events)

    def trim(self, others: int = 0, events: list[Event] | None = None) -> None:
        """Evict free blocks, least recently freed first, until the pool fits ``capacity``
        (one ``BlockRemoved`` each); ``events``: this step's others, published with them."""
        free, cached = self._free, self._cached
        events = [] if events is None else events
        room = self.capacity - others - len(self._refs)
        while len(free) > max(room, 0):
            evicted = free.popitem(last=False)[0]
            cached.discard(evicted)
            events.append(Removed(evicted))
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def announce(self, text: str, blocks: int) -> None:
        """The first ``blocks`` blocks of ``text``, reused by a request that asked for the full
        report (``kv_cache_report_mode = "full"``): one ``BlockStored`` from block 0, as vLLM's
        ``emit_cached_block_events`` sends it (the same hashes again)."""
        if self.publisher is None or blocks <= 0:
            return
        run = chain(piece_ids(text), self.block_size, self._seed)[:blocks]
        self.publisher.publish([Stored([event_hash(d) for d, _ in run], None,
                                       [t for _, block in run for t in block])])

    def clear(self) -> None:
        """Forget every cached hash (vLLM's reset_prefix_cache); blocks in use stay in use."""
        self._cached.clear()
        self._free.clear()
        if self.publisher is not None:
            self.publisher.publish([Cleared()])
