"""The supervisor's model of what each producer holds (docs/behaviour.md "Placement"), from four sources.

1. *What was sent*: every completed prefill, reported by its worker through the holdings ring
   (``narwhal.shm.holdings``) with its producer and its prompt's block keys: the producer now
   holds them, as the most recently used.
2. *What the producer said*: the prefill's ``cached_tokens`` (with ``prompt_tokens`` and the
   prompt's characters giving characters per token) says how many leading blocks it really held.
   Fewer than predicted (``over``): the blocks it lacked were evicted, and vLLM's free queue
   evicts least recently freed first, so every key older than the oldest missing one went too;
   more than predicted (``under``): another replica or client put them there. Within one block:
   ``exact``. vLLM leaves ``prompt_tokens_details`` out of a prefill that hit nothing: once a
   producer has reported cached tokens, its silence means none (before, an engine run without
   ``--enable-prompt-tokens-details`` would have every prediction judged ``over``). Each prefill
   so judged counts once in ``narwhal_holdings_predictions_total{result}``. A prediction counts
   only blocks finished before the prefill started: two prefills of a new prefix placed together
   both compute it (vLLM hits finished blocks only), which is no eviction.
3. *Capacity*: ``vllm:cache_config_info``'s ``num_gpu_blocks`` × ``block_size`` tokens, in our
   blocks at the learned characters per token (4 until learned); the least recently used keys
   beyond it are forgotten. Unknown capacity: bounded by the section's room alone.
4. *Restarts*: a report naming a new engine id (its descriptors' ``remote_engine_id``), or an
   ejection, drops the producer's holdings.

Also learned per producer: the prefill rate (uncached characters per second of prefill, from
prefills placed with nothing queued ahead, as a ratio of exponentially weighted means) and,
fleet wide, the mean uncached characters of a prefill (what a queued request is reckoned to cost).

5. *The engine's own rate* (``supervisor.holdings.engine_rate``, from every load read's ``/metrics``):
   the same for every replica, so it is what scales the homes' rooms (``homes.rate_class``), and
   in the estimate a producer is placed at the learned rates' mean at its class
   (``holdings.rate`` says why: learned rates differ by replica, classes do not).

6. *The engine's own KV-cache events* (``supervisor.kv_events``), where they are followed: the
   token block keys of every block it holds, published beside the learned keys as they are
   (``events``: the supervisor's streams by engine index); a prompt with token ids is placed by
   them (``fleet.placement.held``), one without by the learned keys.

Pure apart from ``publish`` (the shared-memory write): time comes in as an argument. The
record kept per producer is ``supervisor.holdings.producer``'s.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from typing import Any, Protocol

from narwhal.fleet.placement import homes
from narwhal.fleet.placement.token_blocks import DEFAULT_CHARS_PER_TOKEN, FOLLOWED_EMPTY
from narwhal.shm.holdings import Holdings, PrefillReport
from narwhal.supervisor.holdings.fit import Fit, Prefix
from narwhal.supervisor.holdings.lru import drop, leading, reused, touch
from narwhal.supervisor.holdings.producer import HOT_S, ProducerHoldings
from narwhal.supervisor.holdings.rate import placing_rates
from narwhal.supervisor.load_metrics import PrefillCounters

ALPHA = 0.2  # weight of a new sample in the learned means
RATE_MIN_BLOCKS = 8
MAX_PREFIXES = 65536  # live prefixes tracked (first keys); more are not given homes
# A section is published at most this often: each publish makes every worker decode it again
# (a few hundred µs for thousands of keys), and a tenth of a second late costs a prefix nothing
# it would not lose to the round trip of its first prefill anyway.
PUBLISH_S = 0.1
def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + ALPHA * (sample - old)


class EventBlocks(Protocol):
    """One engine's followed KV-cache events, as publishing needs them (``kv_events.stream.Stream``)."""

    @property
    def keys(self) -> dict[Any, int]:
        """Its blocks' token block keys, most recently stored last."""
    @property
    def block_size(self) -> int:
        """Tokens per block (0: nothing stored yet)."""
    @property
    def changes(self) -> int:
        """Moves whenever ``keys`` does."""
    @property
    def in_sync(self) -> bool:
        """A contiguous run of batches is applied: its blocks are the engine's own account."""
    @property
    def report_until(self) -> float:
        """Until when (monotonic) its prefills ask for the full report of reused blocks."""


class Named(Protocol):
    """An engine, as far as homes need it: its name and its index (its slot)."""

    @property
    def name(self) -> str:
        """The engine's configured name (what homes rank by)."""

    @property
    def index(self) -> int:
        """The engine's index: its slot, where its section lies."""


class HoldingsModel:
    """Per engine index, the keys a producer is believed to hold, bounded by ``room`` keys."""

    def __init__(self, stamps: Sequence[int | None], room: int, block_chars: int,
                 engines: Sequence[Named] | None = None) -> None:
        # Per engine index (slot): None: no section (not a producer): reports for it are ignored.
        self.producers = [None if s is None else ProducerHoldings(s) for s in stamps]
        # Per engine index its name's rendezvous hash (homes; no engines: no homes are assigned).
        self.names: list[int] | None = None
        if engines is not None:
            self.names = [0] * len(stamps)
            for e in engines:
                if e.index < len(stamps):
                    self.names[e.index] = homes.key_hash(e.name)
        self.prefixes: dict[int, Prefix] = {}  # live prefixes by first block key
        self.homes_at = float("-inf")
        self._ranks = homes.Ranks()  # kept between assignments: a prefix is ranked once (homes)
        self._homes_from: tuple[object, ...] = ()  # what the last assignment was made from
        self.out: frozenset[int] = frozenset()  # engine indices out of placement (the supervisor's word)
        self.room = room
        self.block_chars = block_chars
        self.mean_uncached: float | None = None
        self.fit = Fit()  # duration against uncached characters, every producer's unqueued prefills
        # Per engine index, its followed KV-cache events (the supervisor's; None: none followed).
        self.events: Callable[[], Mapping[int, EventBlocks]] | None = None
        # Consumers by engine index, their stamps: a section each with their events' blocks alone
        # (placement.skip_prefill_share: a follow-up turn decoded where its prompt already is).
        self.consumer_stamps: dict[int, int] = {}
        # Per consumer's engine index, the block keys of the prompts it decoded, most recent last
        # (learned from traffic as a producer's are, for a fleet without consumers' events), and
        # how often they changed (what its section's publish compares).
        self.consumer_keys: dict[int, OrderedDict[int, None]] = {}
        self._consumer_changes: dict[int, int] = {}
        self._consumers_published: dict[int, tuple[tuple[int, int, bool, int] | None, float]] = {}

    def reshape(self, stamps: Sequence[int | None], engines: Sequence[Named]) -> None:
        """The engines changed (discovery, docs/behaviour.md "Engines that come and go"): per index,
        a producer whose stamp stays keeps what it is believed to hold; a new one starts with
        nothing, a gone one has no section."""
        old = self.producers
        self.producers = [
            None if s is None else (old[i] if i < len(old) and (q := old[i]) is not None and q.stamp == s
                                    else ProducerHoldings(s))
            for i, s in enumerate(stamps)]
        if self.names is not None:
            self.names = [0] * len(stamps)
            for e in engines:
                if e.index < len(stamps):
                    self.names[e.index] = homes.key_hash(e.name)
        self._homes_from = ()  # assign again at the next publish

    def apply(self, rep: PrefillReport) -> str | None:
        """One completed prefill into the model; the prediction's result when it can be judged."""
        if rep.producer >= len(self.producers):
            return None
        p = self.producers[rep.producer]
        if p is None and self.consumer_stamps.get(rep.producer) == rep.identity:
            self._decoded(rep.producer, rep.keys)  # a consumer's completed decode: it holds the prompt
            return None
        if p is None or p.stamp != rep.identity:
            return None  # another engine list's report (a reload): not this producer
        if rep.engine_id and rep.engine_id != p.engine_id:
            if p.engine_id:
                p.forget()  # restarted: a new engine holds nothing of the old one's
            p.engine_id = rep.engine_id
        keys = tuple(rep.keys)  # a report's own tuple (no copy): compared with the last whole
        started = rep.at - rep.duration_s if rep.at else math.inf
        predicted = leading(p, keys, started)
        if rep.prompt_chars and rep.prompt_tokens:
            p.chars_per_token = _ewma(p.chars_per_token, rep.prompt_chars / rep.prompt_tokens)
        result = None
        cpt = p.chars_per_token or DEFAULT_CHARS_PER_TOKEN
        cached_chars = predicted * self.block_chars
        cached_tokens = rep.cached_tokens
        if cached_tokens is not None:
            p.reports_cached = True
        elif p.reports_cached and rep.prompt_tokens is not None:
            cached_tokens = 0  # vLLM leaves the details out of a prefill that hit nothing
        hits = predicted
        if cached_tokens is not None:
            cached_chars = int(cached_tokens * cpt)
            hits = actual = min(cached_chars // self.block_chars, len(keys))
            result = "exact" if abs(actual - predicted) <= 1 else ("over" if predicted > actual else "under")
            if result == "over":
                self._evicted(p, keys[actual])
                # What outlived the eviction is what fits beside this prompt: the room it has for
                # our blocks (less than its capacity when the requests' tails, running requests'
                # pins or another replica's prefixes take the rest; all of it when unknown).
                p.learned_blocks = max(len(p.keys), len(keys))
            elif result == "exact" and p.learned_blocks is not None and len(p.keys) >= p.learned_blocks:
                p.learned_blocks += 1  # held as predicted at the learned bound: perhaps there is more
            elif result == "under":
                p.urgent = True  # another replica's prefix: every worker should know it now
        self._learn_rate(p, rep, cached_chars)
        at = rep.at
        touch(p, keys, at)  # the producer computed or reused every block: now the most recent
        if keys:
            self._used(keys[0], hits, len(keys), at)
        if hits:  # reused: live (those the producer said it held, ours or not)
            reused(p, keys[:hits], at)
        self._trim(p)
        p.dirty = True
        return result

    def _decoded(self, engine: int, keys: Sequence[int]) -> None:
        """A consumer decoded a prompt of ``keys``: now its most recent, bounded by the section's room."""
        held = self.consumer_keys.setdefault(engine, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.room:
            held.popitem(last=False)
        self._consumer_changes[engine] = self._consumer_changes.get(engine, 0) + 1

    def _used(self, first: int, hits: int, blocks: int, at: float) -> None:
        """A prefix (by its first key) was prefilled again, ``hits`` of its ``blocks`` cached.
        Its size is the median of its last few hits (what its requests share, the same in every
        replica; a chat's later turns hit their own history too, and must not make it look
        longer), the prompt's blocks less its own last until one hits."""
        entry = self.prefixes.get(first)
        if entry is None:
            if len(self.prefixes) < MAX_PREFIXES:
                self.prefixes[first] = Prefix(at, max(blocks - 1, 1))
            return
        entry.last = max(entry.last, at)
        entry.uses += 1
        if hits:
            entry.hits.append(hits)

    def assign_homes(self, now: float) -> None:
        """Every live prefix's home (``fleet.placement.homes``): reused within ``HOT_S``."""
        if self.names is None:
            return
        stale = now - HOT_S
        for first in [k for k, e in self.prefixes.items() if e.last < stale]:
            del self.prefixes[first]
        live = [(first, e.size()) for first, e in self.prefixes.items() if e.uses >= 2]
        # Not to producers out of placement (ejected, probing, draining): no replica would send a
        # prefix there, and every replica sees the states alike within a loop.
        indices = [i for i, p in enumerate(self.producers) if p is not None and i not in self.out]
        fastest = self.fastest_engine_rate()  # once for every producer's room
        rooms = [(self.names[i], self.kv_room(i)) for i in indices]
        scaled = [self.home_room(i, fastest) for i in indices]
        if (live, rooms, scaled) == self._homes_from:
            return  # nothing it depends on moved: the same homes
        self._homes_from = (live, rooms, scaled)
        chosen = homes.assign(live, rooms, scaled, self._ranks)
        sizes = dict(live)
        per: dict[int, dict[int, int]] = {i: {} for i in indices}
        for first, at in chosen.items():
            per[indices[at]][first] = sizes[first]
        for i, p in enumerate(self.producers):
            mine = per.get(i, {})  # a producer out of placement keeps none
            if p is not None and mine != p.homes:
                p.homes = mine
                p.dirty = True

    def fastest_engine_rate(self) -> float | None:
        """The highest engine-reported rate among the producers; None before any reports one."""
        rates = [q.engine_rate.rate for q in self.producers if q is not None and q.engine_rate.rate]
        return max(rates) if rates else None

    def kv_room(self, engine: int) -> int:
        """The blocks of homes producer ``engine``'s KV takes whatever its rate: its known capacity's room."""
        p = self.producers[engine]
        assert p is not None
        return homes.room_blocks(self.known_capacity(p))

    def home_room(self, engine: int, fastest: float | None = None) -> int:
        """The blocks of homes producer ``engine`` takes: its known capacity's room, times its
        engine-reported rate's class relative to ``fastest`` (default: :meth:`fastest_engine_rate`)."""
        p = self.producers[engine]
        assert p is not None
        fastest = self.fastest_engine_rate() if fastest is None else fastest
        return homes.room_blocks(self.known_capacity(p), homes.rate_class(p.engine_rate.rate, fastest))

    def _evicted(self, p: ProducerHoldings, key: int) -> None:
        """``key`` was evicted: so was every key less recently used than it (LRU)."""
        if key not in p.keys:
            return
        drop(p)
        for old in list(p.keys):
            del p.keys[old]
            p.hot.pop(old, None)
            if old == key:
                break

    def _learn_rate(self, p: ProducerHoldings, rep: PrefillReport, cached_chars: int) -> None:
        if not rep.prompt_chars:
            return
        uncached = max(rep.prompt_chars - cached_chars, 0)
        self.mean_uncached = _ewma(self.mean_uncached, float(uncached))
        p.mean_uncached = _ewma(p.mean_uncached, float(uncached))
        # Only prefills placed with nothing queued ahead measure the engine: a queue's wait would
        # charge a busy producer twice (once for its queue, again by a rate the queue made look
        # slow). A ratio of means, not a mean of ratios: a small prefill is mostly the round
        # trip, and must not weigh as much as a long one. Less than a block teaches nothing.
        if rep.queued_chars == 0 and rep.duration_s > 0:
            self.fit.add(float(uncached), rep.duration_s)
            if uncached >= RATE_MIN_BLOCKS * self.block_chars:
                first = p.rate is None
                p.work_mean = uncached if first else p.work_mean + ALPHA * (uncached - p.work_mean)
                p.time_mean = rep.duration_s if first else p.time_mean + ALPHA * (rep.duration_s - p.time_mean)
                p.rate = self.rate_of(p)

    def rate_of(self, p: ProducerHoldings) -> float | None:
        """Uncached characters per second of ``p``'s compute: its mean work over its mean time
        less the fleet's fixed cost per prefill (the round trip, the router), which would
        otherwise make a producer that mostly hits look slow (its prefills are mostly that)."""
        if not p.time_mean:
            return p.rate
        fixed = min(self.fit.intercept(4 * self.block_chars), 0.9 * p.time_mean)
        return p.work_mean / (p.time_mean - fixed)

    def known_capacity(self, p: ProducerHoldings) -> int | None:
        """Its KV capacity in our blocks, as ``cache_config_info`` says (the same for every
        replica, which homes need)."""
        if p.capacity_tokens is None:
            return None
        return int(p.capacity_tokens * (p.chars_per_token or DEFAULT_CHARS_PER_TOKEN)) // self.block_chars

    def capacity_blocks(self, p: ProducerHoldings) -> int | None:
        """The blocks it holds at most: its KV capacity, else (an engine that does not say it)
        the room its evictions showed, else unknown (bounded by the section's room alone).
        A known capacity is not lowered by evictions: those also come from the requests' own
        tails and from other replicas converging on the same homes, and a replica that shrank
        its producers for them would scatter what it should keep (measured with
        ``perf.scarce_sim``: two replicas 0.68-0.80 cached with it, 0.77-0.89 without)."""
        known = self.known_capacity(p)
        return known if known is not None else p.learned_blocks

    def _trim(self, p: ProducerHoldings) -> None:
        bound = self.room
        capacity = self.capacity_blocks(p)
        if capacity is not None:
            bound = min(bound, capacity)
        held = p.keys
        if len(held) > bound:
            drop(p)
        while len(held) > bound:  # a full table forgets its oldest keys, as the LRU would
            old, _ = held.popitem(last=False)
            p.hot.pop(old, None)
            p.dirty = True

    def set_capacity(self, engine: int, tokens: int | None) -> None:
        """``num_gpu_blocks × block_size`` as ``cache_config_info`` said (None: not said)."""
        p = self.producers[engine] if engine < len(self.producers) else None
        if p is not None and tokens != p.capacity_tokens:
            p.capacity_tokens = tokens
            p.dirty = True
            self._trim(p)

    def engine_read(self, engine: int, capacity_tokens: int | None, counters: PrefillCounters | None,
                    at: float) -> None:
        """One ``/metrics`` read of engine ``engine`` at ``at``: its capacity (``set_capacity``) and
        its prefill counters (``engine_rate``; None: not reported, the rate as it was)."""
        self.set_capacity(engine, capacity_tokens)
        p = self.producers[engine] if engine < len(self.producers) else None
        if p is not None and counters is not None:
            p.engine_rate.observe(counters, at)

    def forget(self, engine: int) -> None:
        """An ejected or restarted engine: it holds nothing we know of."""
        p = self.producers[engine] if engine < len(self.producers) else None
        if p is not None:
            p.forget()
        if self.consumer_keys.pop(engine, None):
            self._consumer_changes[engine] = self._consumer_changes.get(engine, 0) + 1

    def placing_rates(self) -> list[float | None]:
        """Per engine index, the rate the estimate places it by (``holdings.rate``; None: a consumer)."""
        live = [p for p in self.producers if p is not None]
        rates = iter(placing_rates([self.rate_of(p) for p in live], [p.engine_rate.rate for p in live],
                                   [p.engine_rate.counted for p in live],
                                   [p.chars_per_token or DEFAULT_CHARS_PER_TOKEN for p in live]))
        return [next(rates) if p is not None else None for p in self.producers]

    def restore(self, holdings: Holdings) -> None:
        """Start from what a previous supervisor published (a restart loses no holdings; the
        learned rate restarts from its published value)."""
        for index, p in enumerate(self.producers):
            held = holdings.read(index, p.stamp) if p is not None else None
            if p is None or held is None:
                continue
            order = holdings.read_keys(index, p.stamp) or []
            drop(p)
            p.keys = OrderedDict((key, 0.0) for key in reversed(order))
            p.engine_id, p.rate, p.chars_per_token = held.engine_id, held.prefill_chars_per_s, held.chars_per_token
            if p.rate is not None:
                p.work_mean, p.time_mean = p.rate, 1.0
            p.dirty = False
            if held.mean_uncached_chars:
                self.mean_uncached = held.mean_uncached_chars

    def publish(self, holdings: Holdings, now: float) -> None:
        """Every changed producer's section not published in the last ``PUBLISH_S``, most
        recent key first."""
        if now - self.homes_at >= PUBLISH_S:
            self.homes_at = now
            self.assign_homes(now)
        rates = self.placing_rates()  # once per pass: each depends on every producer's
        followed = self.events() if self.events is not None else {}
        for index, p in enumerate(self.producers):
            if p is None:
                continue
            hot = p.hot_blocks(now) if p.hot else 0  # nothing reused lately: nothing to age (most passes)
            if hot != p.published_hot:
                p.dirty = True  # the live count moves with time alone, as reuses age out
            events = followed.get(index)
            marker = None if events is None else (id(events), events.changes if events.in_sync else -1,
                                                  now < events.report_until)
            if marker != p.published_events:
                p.dirty = True
            if not p.dirty or (now - p.published_at < PUBLISH_S and not p.urgent):
                continue
            p.dirty = p.urgent = False
            p.published_at = now
            p.published_hot = hot
            keys = list(reversed(p.keys))
            p.rate = self.rate_of(p)
            p.published_events = marker
            token_keys, block_tokens = _token_keys(events, holdings.layout.token_keys)
            holdings.publish(index, p.stamp, p.engine_id, keys, self.capacity_blocks(p), rates[index],
                             p.chars_per_token, p.mean_uncached or self.mean_uncached or 0.0, hot, p.homes,
                             token_keys, block_tokens, report_full=marker is not None and marker[2])
        self._publish_consumers(holdings, followed, now)

    def _publish_consumers(self, holdings: Holdings, followed: Mapping[int, EventBlocks], now: float) -> None:
        """Each consumer's section, its events' token keys alone, when they moved (at most every
        ``PUBLISH_S``); an empty one when its events stop being followed."""
        for index, stamp in self.consumer_stamps.items():
            events = followed.get(index)
            learned = self._consumer_changes.get(index, 0)
            if events is None:
                marker = None if not learned else (0, -1, False, learned)
            else:
                marker = (id(events), events.changes if events.in_sync else -1, False, learned)
            published = self._consumers_published.get(index)
            if published is not None and (published[0] == marker or now - published[1] < PUBLISH_S):
                continue
            if published is None and marker is None:
                continue  # never followed nor decoded on: nothing to say
            self._consumers_published[index] = (marker, now)
            token_keys, block_tokens = _token_keys(events, holdings.layout.token_keys)
            keys = list(reversed(self.consumer_keys.get(index, ())))
            holdings.publish(index, stamp, 0, keys, None, None, None, 0.0, token_keys=token_keys,
                             block_tokens=block_tokens)


def _token_keys(events: EventBlocks | None, room: int) -> tuple[list[int], int]:
    """An engine's token block keys, most recent first, at most ``room``; and its block size (0:
    not followed, its stream not in order, or no room for them; ``FOLLOWED_EMPTY``: followed, nothing stored yet)."""
    if events is None or not events.in_sync or room <= 0:
        return [], 0
    if events.block_size <= 0:
        return [], FOLLOWED_EMPTY
    return list(islice(reversed(events.keys.values()), room)), events.block_size
