"""``perf.scarce_sim``'s producer: the fake engine's models (``narwhal.fake_engine.work``) in simulated time.

Why its own module: the simulation's loop, hosts and rows are ``perf.scarce_sim``'s; what a
producer does with a prefill (batch slots in FIFO order, one prefill lane, vLLM's block pool, the
counters its ``/metrics`` would show) is the fake's, and stays beside it true to it.

Invariant: its counters move as the fake's do: ``queries``/``hits`` as a prefill is looked up
(``vllm:prefix_cache_*_total``), ``prefill_s``/``prefilled`` as it finishes, from its slot to its
prefill done (``vllm:request_prefill_time_seconds``: the lane's wait in, the batch queue's out).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from narwhal.fake_engine.prefix import PrefixCache
from narwhal.supervisor.load_metrics import PrefillCounters
from perf.load.scarce import KV_BLOCKS, MAX_NUM_SEQS


class Clock(Protocol):
    """The simulation's loop, as a producer needs it: the time, and a call at a later time."""

    now: float

    def at(self, when: float, fn: Callable[[], None]) -> None: ...


@dataclass
class Prefill:
    """One prefill leg at a producer."""

    hashes: list[int]
    tokens: int
    done: Callable[[int], None]  # called with the cached tokens when it is computed
    blocks: int = 0


class Producer:
    """A fake producer (``fake_engine.work``): batch slots in FIFO order, one prefill lane, vLLM's block pool."""

    def __init__(self, loop: Clock, s_per_token: float) -> None:
        self.loop = loop
        self.s_per_token = s_per_token
        self.cache = PrefixCache(KV_BLOCKS)
        self.running = 0
        self.running_blocks = 0
        self.waiting: deque[Prefill] = deque()
        self.free_at = 0.0
        self.queries = self.hits = self.prefills = 0
        self.prefill_s = 0.0  # vLLM's prefill-time histogram: its _sum and _count
        self.prefilled = 0

    def submit(self, job: Prefill) -> None:
        if self.running < MAX_NUM_SEQS and not self.waiting:
            self._start(job)
        else:
            self.waiting.append(job)

    def _start(self, job: Prefill) -> None:
        self.running += 1
        cache = self.cache
        cache.acquire(job.hashes)
        job.blocks = max(job.tokens // cache.block_size - len(job.hashes), 0)
        self.running_blocks += job.blocks
        cache.trim(self.running_blocks)
        cached = cache.lookup(job.hashes, job.tokens)
        self.queries += job.tokens
        self.hits += cached
        self.prefills += 1
        now = self.loop.now
        self.free_at = max(now, self.free_at) + self.s_per_token * (job.tokens - cached)
        self.loop.at(self.free_at, lambda: self._finish(job, cached, now))

    def _finish(self, job: Prefill, cached: int, scheduled: float) -> None:
        self.prefill_s += self.loop.now - scheduled
        self.prefilled += 1
        self.cache.insert(job.hashes, self.running_blocks)
        self.running_blocks -= job.blocks
        self.cache.release(job.hashes)
        self.running -= 1
        job.done(cached)
        if self.waiting and self.running < MAX_NUM_SEQS:
            self._start(self.waiting.popleft())

    def kv_usage(self) -> float:
        return min((self.cache.in_use + self.running_blocks) / KV_BLOCKS, 1.0)

    def counters(self) -> PrefillCounters:
        """What its ``/metrics`` would say of its prefills (``supervisor.load_metrics.parse_prefill``)."""
        return PrefillCounters(self.prefill_s, float(self.prefilled), float(self.queries), float(self.hits))
