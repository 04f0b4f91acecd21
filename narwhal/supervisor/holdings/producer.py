"""One producer's holdings as the supervisor believes them: the record :class:`HoldingsModel`
(``narwhal.supervisor.holdings``) keeps per producer, and what "hot" means for its keys.

Invariant: only the supervisor writes these records (its one loop); the workers see what
``HoldingsModel.publish`` makes of them in the holdings region, never the records themselves.
Why a module of its own: the record is the model's state, worked on by the LRU steps
(``supervisor.holdings.lru``, through their ``Lru`` view of it) as well as by the model, and it
has its own vocabulary (hot keys, the last head kept whole, the urgent publish).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from narwhal.supervisor.holdings.engine_rate import EngineRate
from narwhal.supervisor.holdings.lru import drop, hot_count

# A block reused within this many seconds is *hot*: a live prefix whose eviction would be paid
# for again soon. Long enough to span the gap between a chat's turns and between uses of a
# tenant's system prompt at a few requests a second; short enough that a prefix its traffic has
# left stops protecting the blocks it sits on within a couple of publishes of the load moving.
HOT_S = 2.0


@dataclass
class ProducerHoldings:
    """What the supervisor believes one producer holds and how fast it prefills; the one copy,
    which only the supervisor writes (the workers read what :meth:`HoldingsModel.publish` makes of it)."""

    stamp: int
    # Least recently used first; each key with when it was first computed there (monotonic s).
    keys: OrderedDict[int, float] = field(default_factory=OrderedDict)
    engine_id: int = 0
    capacity_tokens: int | None = None
    chars_per_token: float | None = None
    rate: float | None = None  # uncached characters per second of prefill
    mean_uncached: float | None = None  # of its prefills (all of them): what one not ours is reckoned
    work_mean: float = 0.0  # of the prefills placed with nothing queued ahead: uncached characters …
    time_mean: float = 0.0  # … and seconds, both exponentially weighted (their ratio is the rate)
    reports_cached: bool = False  # it said cached_tokens once: from then on, silence means 0
    # The keys reused (a prefill hit them, by its report) within HOT_S, least recently reused
    # first, with when: the live part of ``keys`` (a subset: a key that goes goes from both).
    hot: OrderedDict[int, float] = field(default_factory=OrderedDict)
    # The last prompt touched and the last run reused, kept whole (``holdings.lru`` says why).
    head: tuple[int, ...] = ()
    hot_head: tuple[int, ...] = ()
    hot_head_at: float = 0.0
    hot_head_since: float | None = None
    hot_stale: bool = False
    published_hot: int = 0
    homes: dict[int, int] = field(default_factory=dict)  # first key -> blocks, its live prefixes' homes here
    learned_blocks: int | None = None  # the room its evictions showed (None: none seen)
    urgent: bool = False  # an ``under``: published at the next pass, not after PUBLISH_S
    engine_rate: EngineRate = field(default_factory=EngineRate)  # as its /metrics say (tokens/s)
    dirty: bool = True
    published_at: float = float("-inf")
    published_events: tuple[int, int, bool] | None = None  # (its event stream, its changes, full report) published

    def forget(self) -> None:
        """A new engine behind the name (restarted, or ejected and back): nothing it held is held."""
        self.learned_blocks = None  # a new engine: what the old one's evictions showed is moot
        if self.keys:
            drop(self)
            self.keys.clear()
            self.hot.clear()
            self.dirty = True

    def hot_blocks(self, now: float) -> int:
        """Keys reused within ``HOT_S`` of ``now`` (older ones stop counting as live)."""
        return hot_count(self, now - HOT_S)
