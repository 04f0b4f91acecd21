"""One producer's held KV blocks: the table that ``delay_free_blocks`` keeps alive until a read.

Invariant: entries sit in insertion order and expire in that same order, because the lease is
constant per engine (``expires_at = insertion time + lease_s``). So a sweep pops from the front of
the dict and stops at the first live entry: its cost is proportional to what expires, not to what
is held, which matters when a perf run strands thousands of prefills. Every access that can free
blocks sweeps first, so a read racing the engine's periodic sweeper still sees an expired entry as
expired (a late read), never as a successful one.

Pure data with no engine, no I/O and no imports from the rest of the fake: the engine state
(``state.py``) owns one ``KvStore``, and the handoff (``kv.py``) works on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class HeldEntry:
    """A handoff's held blocks and when its lease runs out (monotonic seconds)."""

    blocks: list[int]
    expires_at: float


@dataclass(slots=True)
class KvStore:
    """One producer's held KV blocks and the counters around them."""

    lease_s: float
    block_size: int
    held: dict[str, HeldEntry] = field(default_factory=dict)
    next_block: int = 0
    held_blocks: int = 0
    kv_reads: int = 0
    late_reads: int = 0
    expired_blocks: int = 0
    expired_requests: int = 0

    def allocate(self, remote_request_id: str, prompt_tokens: int) -> list[int]:
        """Pin ``cdiv(prompt_tokens, block_size)`` fresh blocks until read or lease expiry: the
        partial last block is sent too (vLLM's ``request_finished``; a real engine answered a
        212-token prompt with two blocks of 128, an 8-token one with one)."""
        n = -(-prompt_tokens // self.block_size)
        start = self.next_block
        self.next_block = start + n
        blocks = list(range(start, start + n))
        self.held[remote_request_id] = HeldEntry(blocks, time.monotonic() + self.lease_s)
        self.held_blocks += n
        return blocks

    def unique_request_id(self, candidate: str) -> str:
        """``candidate`` unless already held (a reused X-Request-Id must not clobber an entry)."""
        if candidate not in self.held:
            return candidate
        k = 1
        while f"{candidate}-{k}" in self.held:
            k += 1
        return f"{candidate}-{k}"

    def release(self, remote_request_id: str) -> int | None:
        """A consumer read the blocks: free them. None means unknown or expired (a late read)."""
        self.sweep()
        entry = self.held.pop(remote_request_id, None)
        if entry is None:
            self.late_reads += 1
            return None
        self.held_blocks -= len(entry.blocks)
        self.kv_reads += 1
        return len(entry.blocks)

    def sweep(self, now: float | None = None) -> None:
        """Free every entry whose lease ran out by ``now``; stops at the first live one (insertion order)."""
        if not self.held:
            return
        now = time.monotonic() if now is None else now
        expired: list[str] = []
        for key, entry in self.held.items():
            if entry.expires_at > now:
                break
            expired.append(key)
        for key in expired:
            entry = self.held.pop(key)
            self.held_blocks -= len(entry.blocks)
            self.expired_blocks += len(entry.blocks)
            self.expired_requests += 1
