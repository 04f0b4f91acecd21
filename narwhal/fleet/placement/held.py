"""Policy ``held`` (docs/behaviour.md "Placement", the default): the producer that will hand off soonest, knowing what
each holds.

For each candidate producer: *matched* = the characters of the longest leading run of this
prompt's blocks it is believed to hold (the supervisor's holdings, read from shared memory);
*estimated time to handoff* = (its queued prefill work + this prompt's uncached characters ×
``MISS_WEIGHT`` + the live characters it would evict × ``EVICT_WEIGHT``) ÷ its prefill rate.
Queued work is its prefill load (this host's in-flight prefill legs plus what it reports running
and waiting that is not ours): this host's legs by their own uncached characters (summed in
shared memory by every worker), the others' requests each reckoned at that producer's mean
uncached characters per prefill (else the fleet's; this prompt's length while none is known).
The rate is the one published for the producer (``supervisor.holdings.rate``: the learned rates'
mean at its engine-reported class), else the candidates' mean, else 1. The least estimate
wins; candidates within ``placement.held.affinity_slack`` of it are ordered home first
(``homes``), then by the rendezvous rank of the prompt's first block key, so workers and
replicas that know nothing yet (every estimate equal) still agree.

Deviations from docs/behaviour.md "Placement" (README "Placement"), each measured with ``perf.scarce_sim``:

* A miss counts ``MISS_WEIGHT`` (9) times its uncached characters: its prefill, and the queue it
  holds up behind it on an engine that prefills one batch at a time; counted once, a short queue
  beats a held prefix on every fluctuation and each such miss evicts another prefix.
* Eviction is charged by what is *live*: the producer's ``hot_blocks`` (reused in the last few
  seconds, ``supervisor.holdings.HOT_S``) plus the prompt's new blocks beyond its capacity are
  live blocks the prefill evicts, each to be prefilled again (``evicted_chars``). A full cache of
  stale prefixes costs nothing to fill; one full of live ones does.
* A prefix's *home* (``fleet.placement.homes``, the same in every replica) is reckoned as
  holding it, and a saturated home stays a candidate like a holder: that is how a second replica
  finds where the first put a prefix without any shared state.
* A saturated producer (KV usage at ``kv_saturated``) goes last only when it holds none of the
  prompt and is not its home: a scarce KV is always nearly full, and a hit shares the blocks.

Invariants, and why:

* Pure: no I/O, no clock; holdings, loads and the rendezvous hashes come in as arguments.
* The lookup stops at the first block no candidate holds: a prompt whose prefix nobody holds
  costs its first block key and one set lookup per candidate; a long held prefix costs its
  matched blocks, each key computed once (``blocks.PrefixBlocks``).
* The choice's label (``producer_choice``): ``held`` when the producer holds ≥ 1 block of the
  prompt, ``rendezvous`` when no candidate holds any (the rank decided), else ``least_loaded``
  (a holder was passed over for a producer that hands off sooner without it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from narwhal.fleet import Engine
from narwhal.fleet.placement.affinity import Affinity, key_hash, score
from narwhal.fleet.placement.blocks import MEMO_BLOCKS, KeyMemo, PrefixBlocks
from narwhal.fleet.placement.holdings_source import HeldReading, HoldingsSource
from narwhal.fleet.placement.policy import (
    Asked,
    Candidate,
    Ordered,
    PolicyRegion,
    PrefillFacts,
    PromptText,
    producer_index,
)
from narwhal.fleet.placement.token_blocks import DEFAULT_CHARS_PER_TOKEN, FOLLOWED_EMPTY, TokenBlocks, cached_tokens
from narwhal.settings import PlacementSettings

if TYPE_CHECKING:
    from narwhal.fleet.placement.reservation import Reservation

T = TypeVar("T")

_NOTHING: frozenset[int] = frozenset()
MISS_WEIGHT = 9.0  # a miss: its own prefill, and the requests queued behind it meanwhile
# A live block evicted: prefilled again by a later request, which waits as above, and the prefix
# it belonged to is then scattered between two producers (twice the miss's weight: measured).
EVICT_WEIGHT = 18.0


def keys_of(readings: Sequence[HeldReading | None], index: int) -> frozenset[int]:
    """The block keys engine ``index`` is believed to hold (none without a reading)."""
    reading = readings[index] if index < len(readings) else None
    return reading.keys if reading is not None else _NOTHING


def holds_first(readings: Sequence[HeldReading | None], index: int, first: int) -> bool:
    """Engine ``index`` holds the block keyed ``first``, or is the home of the prefix it opens."""
    reading = readings[index] if index < len(readings) else None
    if reading is None:
        return False
    return first in reading.keys or (reading.homes is not None and first in reading.homes)


def matched_blocks(blocks: PrefixBlocks, sets: Sequence[frozenset[int]]) -> list[int]:
    """Per candidate, how many of the prompt's leading blocks it holds; stops at the first
    block no candidate holds.

    The walk reads the keys' list and asks for more only when it runs out (as
    :meth:`PrefixBlocks.key` would: 4, then doubling), not one method call per block. Each run
    is the leading run block by block, no key taken to imply the ones before it: the
    supervisor's LRU touches a prompt's head last, so its sets are closed under prefixes, but a
    search relying on that would save tens of ns per block, and the keys are what cost."""
    runs = [0] * len(sets)
    count, keys = blocks.count, blocks.computed  # the shared list, grown in place as keys are asked for
    known = len(keys)
    for i, held in enumerate(sets):
        if held:
            run = 0  # keys are computed as far as the longest run asks, once each (PrefixBlocks)
            while run < count:
                if run == known:  # the next batch: keys(n) computes exactly min(n, count), no len() asked
                    known = 2 * run if run > 2 else 4
                    if known > count:
                        known = count
                    blocks.keys(known)
                if keys[run] not in held:
                    break
                run += 1
            runs[i] = run
    return runs


def order(
    items: list[T],
    blocks: PrefixBlocks,
    held: Sequence[HeldReading | None],
    index: Callable[[T], int],
    engine_hash: Callable[[T], int],
    ours: Callable[[T], float],
    others: Callable[[T], float],
    slack: float,
) -> tuple[list[T], list[tuple[int, int, int, int]]]:
    """``items`` in the order to try them, and for each (same order) the characters it matched,
    the prompt's characters it would compute, the queued work ahead of them, and the cached tokens
    its KV-cache events predict (-1: none: not followed, or the prompt has no token ids). A
    followed producer is matched by the prompt's token blocks when the request path got them
    (``blocks.tokens``), its learned keys unused: its events are the truth. ``ours``: this
    host's in-flight prefill work there, in characters; ``others``: its requests not ours."""
    size = len(held)
    readings = [held[i] if (i := index(item)) < size else None for item in items]
    tokens = blocks.tokens
    runs = matched_blocks(blocks, [_NOTHING if r is None or (tokens is not None and r.block_tokens) else r.keys
                                   for r in readings])
    predicted = _by_events(blocks, tokens, readings, runs) if tokens is not None else None
    if len(items) == 1:  # its estimate and rank order nothing: only its facts are asked for
        item, reading = items[0], readings[0]
        matched = runs[0] * blocks.block_chars
        queued = _queued(item, reading, _fleet_mean(readings, blocks), ours, others)
        uncached = len(blocks.text) - matched
        tokens_cached = -1 if predicted is None else predicted[0]
        return items, [(matched, uncached if uncached > 0 else 0, int(queued), tokens_cached)]
    first = blocks.key(0)
    home = [r is not None and r.homes is not None and first in r.homes for r in readings]
    estimates, facts = _estimates(items, blocks, readings, runs, home, ours, others, predicted)
    bound = min(estimates) * (1 + slack) + 1e-9
    ranked = sorted(
        range(len(items)),
        key=lambda i: (False, not home[i], -score(first, engine_hash(items[i]))) if estimates[i] <= bound
        else (True, False, estimates[i]),
    )
    return [items[i] for i in ranked], [facts[i] for i in ranked]


def _by_events(blocks: PrefixBlocks, tokens: TokenBlocks, readings: list[HeldReading | None],
               runs: list[int]) -> list[int]:
    """For each candidate whose KV-cache events are followed, its run of the prompt's token blocks
    (in place of the learned one, in ``runs``: as the characters those tokens cover, in whole
    character blocks) and the cached tokens it will report (the list returned; -1 where not
    followed)."""
    predicted = [-1] * len(readings)
    ids = len(tokens.ids)
    text = len(blocks.text)
    for i, reading in enumerate(readings):
        if reading is None or not reading.block_tokens:
            continue
        size = reading.block_tokens
        run = tokens.matched(size, reading.token_keys) if reading.token_keys and size != FOLLOWED_EMPTY else 0
        predicted[i] = cached_tokens(run, size, ids)
        if run and ids:  # the prompt's own characters per token, unless its text was cut
            per_token = text / ids if not blocks.cut else reading.chars_per_token or DEFAULT_CHARS_PER_TOKEN
            chars = min(int(run * size * per_token), text)
            runs[i] = min(chars // blocks.block_chars, blocks.count)
        else:
            runs[i] = 0
    return predicted


def _estimates(
    items: list[T], blocks: PrefixBlocks, readings: list[HeldReading | None], runs: list[int], home: list[bool],
    ours: Callable[[T], float], others: Callable[[T], float], predicted: list[int] | None,
) -> tuple[list[float], list[tuple[int, int, int, int]]]:
    """Per candidate its estimated time to handoff, and (matched, uncached, queued) characters
    with the cached tokens its events predict (-1: not followed, or no token ids)."""
    width = blocks.block_chars
    prompt = len(blocks.text)
    known = [r.prefill_chars_per_s for r in readings if r is not None and r.prefill_chars_per_s]
    default_rate = sum(known) / len(known) if known else 1.0
    fleet_mean = _fleet_mean(readings, blocks)
    first = blocks.key(0)
    estimates: list[float] = []
    facts: list[tuple[int, int, int, int]] = []
    for i, (item, reading, run, at_home) in enumerate(zip(items, readings, runs, home, strict=True)):
        rate = default_rate if reading is None else reading.prefill_chars_per_s or default_rate
        queued = _queued(item, reading, fleet_mean, ours, others)
        uncached = max(prompt - run * width, 0)
        facts.append((run * width, uncached, int(queued), -1 if predicted is None else predicted[i]))
        if at_home:  # every replica sends it there: reckoned held (homes.py says why)
            assert reading is not None and reading.homes is not None
            uncached = max(prompt - max(run, min(reading.homes[first], blocks.count)) * width, 0)
        estimates.append((queued + uncached * MISS_WEIGHT + evicted_chars(reading, uncached, width)) / rate)
    return estimates, facts


def _fleet_mean(readings: list[HeldReading | None], blocks: PrefixBlocks) -> float:
    """What a request not ours stands for where its producer's mean is unknown: the candidates'
    largest mean uncached characters per prefill, else this prompt's length."""
    means = [r.mean_uncached_chars for r in readings if r is not None and r.mean_uncached_chars > 0]
    return max(means) if means else float(len(blocks.text))


def _queued(
    item: T, reading: HeldReading | None, fleet_mean: float, ours: Callable[[T], float], others: Callable[[T], float],
) -> float:
    """The queued prefill work ahead of a prompt there, in characters: ours, and each request
    not ours at its producer's mean uncached characters (else the fleet's)."""
    per_request = fleet_mean if reading is None else reading.mean_uncached_chars or fleet_mean
    return ours(item) + others(item) * per_request


def evicted_chars(reading: HeldReading | None, uncached: int, width: int) -> float:
    """The live characters a prefill of ``uncached`` new characters would evict there: its new
    blocks beyond the room its cold blocks leave (capacity − hot blocks), at most the hot blocks.
    Unknown capacity: as large as what it is seen to hold."""
    if reading is None or not uncached:
        return 0.0
    hot = reading.hot_blocks
    if not hot:
        return 0.0
    capacity = reading.capacity_blocks if reading.capacity_blocks is not None else reading.blocks
    over = min(hot + -(-uncached // width) - capacity, hot)  # new blocks beyond the cold ones' room
    return over * width * EVICT_WEIGHT if over > 0 else 0.0


def choice_label(matched: int, anyone_held: bool) -> str:
    """``producer_choice`` for a producer that matched ``matched`` characters."""
    if matched > 0:
        return "held"
    return "least_loaded" if anyone_held else "rendezvous"


@dataclass(slots=True)
class HeldPlaced:
    """A reservation's note under ``held`` (``Reservation.note``): the prompt's blocks and what
    placement reckoned of the chosen producer."""

    blocks: PrefixBlocks
    predicted_cached_chars: int | None  # the prompt's characters it was believed to hold (None: not reckoned)
    queued_chars: int  # the queued prefill work reckoned ahead of it there
    work: int  # its uncached characters, counted as this host's queued work there until the prefill ends
    predicted_cached_tokens: int | None = None  # the cached tokens its KV-cache events predict (None: not known)


class Held:
    """Policy ``held``: producers by :func:`order` when the prompt has a full block (its note is
    the prompt's :class:`~narwhal.fleet.placement.blocks.PrefixBlocks`); a shorter prompt by the
    affinity rule (:class:`~narwhal.fleet.placement.affinity.Affinity`, its note the key).

    ``holdings``: what each producer holds and this host's prefill work on each, and where
    finished prefills are reported (the worker's view of the holdings region); None outside
    gunicorn, where it places by rendezvous rank and load alone."""

    name = "held"

    def __init__(self, settings: PlacementSettings, holdings: HoldingsSource | None = None) -> None:
        self.settings = settings  # what every policy shares (the affinity rule's, for a short prompt)
        self.own = settings.held  # [placement.held]: its own table
        self.holdings = holdings
        self._short = Affinity(settings)
        self._memo = KeyMemo(MEMO_BLOCKS)  # this worker's block keys already computed, never shared

    @staticmethod
    def region(settings: PlacementSettings) -> PolicyRegion:
        """The holdings region: ``holdings_slots`` keys shared among the configured producers, a
        prefill report's keys up to ``max_prefix_chars`` (at most 4096 blocks)."""
        own = settings.held
        return PolicyRegion(own.holdings_slots, min(own.max_prefix_chars // own.block_chars, 4096),
                            create="narwhal.shm.holdings:create_region",
                            worker="narwhal.shm.holdings_view:worker_view",
                            supervisor="narwhal.supervisor.holdings.part:HoldingsPart")

    def prepare(self, prompt: PromptText) -> PrefixBlocks | int | None:
        """The prompt's prefix blocks when it has a full block, read to one character past
        ``max_prefix_chars`` (so a reporter tells a whole prompt from a cut one; keys computed
        lazily); else its affinity key (a prompt shorter than a block still goes by it)."""
        own, settings = self.own, self.settings
        head = prompt(own.max_prefix_chars + 1)
        if head is None:
            return None
        size = len(head)
        if size >= own.block_chars:
            blocks = PrefixBlocks(head, own.block_chars, own.max_prefix_chars, self._memo)
            blocks.answer = prompt.answer_span  # asked (with this limit) only by holders
            return blocks
        if size < settings.affinity_min_chars:
            return None
        return key_hash(head[: settings.affinity_chars])

    def wants_tokens(self, note: Any) -> bool:
        """A prompt with blocks, while some producer's KV-cache events are followed: its token
        blocks are compared with theirs (:func:`order`)."""
        if not isinstance(note, PrefixBlocks) or not note.count or self.holdings is None:
            return False
        return any(r is not None and r.block_tokens for r in self.holdings.current())

    def tokens(self, note: Any, ids: Sequence[int]) -> None:
        """The prompt's token ids: kept with its blocks."""
        if isinstance(note, PrefixBlocks):
            note.tokens = TokenBlocks(ids)

    def holders(self, note: Any, consumers: Sequence[Engine], share: float) -> list[Engine]:
        """The consumers that hold at least ``share`` of the prompt's blocks as a leading run, the
        most first (docs/behaviour.md "Placement": a follow-up turn decoded where the previous
        turn left it): by their KV-cache events' token blocks where the prompt has token ids and
        the consumer's events are followed, else by the prompts it decoded (learned, as a
        producer's holdings are)."""
        if not isinstance(note, PrefixBlocks) or self.holdings is None or share <= 0:
            return []
        tokens = note.tokens
        readings = self.holdings.current()
        found: list[tuple[float, int, Engine]] = []
        for position, engine in enumerate(consumers):
            reading = readings[engine.index] if engine.index < len(readings) else None
            if reading is None:
                continue
            if tokens is not None and reading.token_keys and reading.block_tokens not in (0, FOLLOWED_EMPTY):
                total = tokens.count(reading.block_tokens)
                held = tokens.matched(reading.block_tokens, reading.token_keys) / total if total else 0.0
            elif reading.keys and note.count:
                run = matched_blocks(note, [reading.keys])[0]
                if run and run < share * note.count:
                    run = self._with_answer(note, run)
                held = run / note.count
            else:
                continue
            if held >= share:
                found.append((-held, position, engine))
        return [engine for _, _, engine in sorted(found)]

    def _with_answer(self, note: PrefixBlocks, run: int) -> int:
        """A consumer's learned leading ``run`` of the prompt's blocks, with the answer of the
        turn before counted in when the run reaches it: learned holdings come from the prompts a
        consumer decoded, and the one that decoded the turn before holds, right after that prompt,
        the answer it wrote (vLLM caches the blocks its decode fills), which the next turn sends
        back. Its place is asked of the prompt once, the first time a run needs it."""
        span = note.answer
        if callable(span):
            span = note.answer = span(self.own.max_prefix_chars + 1)
        if span is None:
            return run
        start, end = span
        width = note.block_chars
        if run < start // width:  # it never held what came right before the answer
            return run
        return max(run, min(end // width, note.count))

    def keeps_saturated(self, asked: Asked) -> Callable[[Candidate], bool] | None:
        """A saturated producer that holds the prompt's first block, or is its home, stays a
        candidate: a scarce KV is always nearly full of cached prefixes, and a hit shares them."""
        blocks = asked.note
        if not isinstance(blocks, PrefixBlocks) or not blocks.count:
            return None
        source = self.holdings
        readings = source.current() if source is not None else ()
        first = blocks.key(0)
        return lambda c: holds_first(readings, c[0].index, first)

    def order(self, candidates: list[Candidate], asked: Asked) -> Ordered:
        """The least estimated time to handoff first, near-ties by rendezvous rank (:func:`order`)."""
        blocks = asked.note
        if not isinstance(blocks, PrefixBlocks) or not blocks.count or not candidates:
            return self._short.order(candidates, asked)
        source = self.holdings
        readings: Sequence[HeldReading | None]
        if source is not None:
            readings, work = source.current(), source.work()
            extra = asked.loads.extra if asked.loads is not None else None
            ours: Callable[[Candidate], float] = lambda c: work[c[0].index]  # noqa: E731
            others: Callable[[Candidate], float] = (  # noqa: E731
                (lambda c: extra[c[0].index]) if extra is not None else (lambda c: 0.0))
        else:  # no holdings region (outside gunicorn): every request at the mean
            readings, ours, others = (), (lambda c: 0.0), asked.load
        hashes = asked.hashes
        ordered, facts = order(candidates, blocks, readings, producer_index, lambda c: hashes[c[0].index],
                               ours, others, self.own.affinity_slack)
        anyone = max(facts)[0] > 0  # a candidate matched something (facts lead with matched chars): one C call

        def choice(position: int, producer: Engine) -> str:
            return choice_label(facts[position][0], anyone)

        return Ordered(ordered, choice, facts)

    def placed(self, resv: Reservation, note: Any, ordered: Ordered, position: int) -> None:
        """A prompt with blocks keeps them and what was reckoned of its producer; its uncached
        characters count as this host's queued work there until its prefill ends. A producer
        tried last (set aside as saturated) matched nothing; one the fallback's pass chose, or a
        consumer that holds the prompt, was not reckoned at all."""
        if not isinstance(note, PrefixBlocks):
            return
        facts: list[tuple[int, int, int, int]] | None = ordered.kept
        if facts is None:
            resv.note = HeldPlaced(note, None, 0, 0)
            return
        matched, uncached, queued, tokens = facts[position] if position < len(facts) else (0, len(note.text), 0, -1)
        holdings, work = self.holdings, 0
        if holdings is not None and uncached:
            work = uncached
            holdings.add_work(resv.producer.index, work)
        resv.note = HeldPlaced(note, matched, queued, work, None if tokens < 0 else tokens)
        if holdings is not None:  # its events newly followed: a late joiner asks for the full report
            readings = holdings.current()
            index = resv.producer.index
            reading = readings[index] if index < len(readings) else None
            resv.report_full = reading is not None and reading.report_full

    def prefilled(self, resv: Reservation, result: PrefillFacts) -> None:
        """The finished prefill for the holdings (docs/behaviour.md "Placement"): its producer,
        engine id, block keys (finished here, off the client's critical path) and what the
        producer said it cached."""
        if self.holdings is None:
            return
        placed: HeldPlaced = resv.note
        blocks = placed.blocks
        descriptor = result.descriptor
        engine_id = descriptor.get("remote_engine_id") if isinstance(descriptor, dict) else None
        self.holdings.report_prefill(
            resv.producer.index, engine_id if isinstance(engine_id, str) else None,
            0 if blocks.cut else len(blocks.text), result.prompt_tokens, result.cached_tokens,
            max(result.finished_at - result.started_at, 0.0), blocks.keys(), placed.queued_chars, result.finished_at,
        )

    def decoded(self, resv: Reservation, at: float) -> None:
        """Its decode completed: the consumer holds the prompt now (vLLM caches a handoff's
        blocks once they arrive), reported as a prefill of its own for the consumer's learned
        holdings (docs/behaviour.md "Placement": follow-up turns, without KV-cache events); a
        turn it decoded alone too. An engine that also prefills hears only of a handoff it took:
        what it prefilled itself was reported by its prefill."""
        if self.holdings is None or (resv.consumer.can_prefill and not resv.crossed):
            return
        placed: HeldPlaced = resv.note
        blocks = placed.blocks
        self.holdings.report_prefill(resv.consumer.index, None, 0 if blocks.cut else len(blocks.text), None, None,
                                     0.0, blocks.keys(), 0, at)

    def released(self, resv: Reservation) -> None:
        """Its prefill ended: its uncached characters are no longer queued there."""
        placed: HeldPlaced = resv.note
        if placed.work and self.holdings is not None:
            self.holdings.add_work(resv.producer.index, -placed.work)
        placed.work = 0

    def describe(self, engine: Engine) -> dict[str, Any] | None:
        """What the supervisor believes the producer holds (docs/behaviour.md "Placement"); for a
        consumer, the blocks its KV-cache events say it holds; None without the holdings, or before
        anything was published for it."""
        readings = self.holdings.current() if self.holdings is not None else ()
        held = readings[engine.index] if engine.index < len(readings) else None
        if held is None:
            return None
        if not engine.can_prefill:  # a consumer: what its events say it holds (placement.skip_prefill_share)
            followed = 0 < held.block_tokens != FOLLOWED_EMPTY
            return {"blocks": held.blocks,  # learned: the prompts it decoded
                    "event_blocks": len(held.token_keys) if held.block_tokens else None,
                    "block_tokens": held.block_tokens if followed else None}
        return {
            "blocks": held.blocks,
            "capacity_blocks": held.capacity_blocks,
            "chars_per_token": held.chars_per_token,
            "prefill_chars_per_s": held.prefill_chars_per_s,
            "hot_blocks": held.hot_blocks,  # reused in the last few seconds: the live part of blocks
            "homes": len(held.homes or ()),  # live prefixes every replica sends here first
            # Its KV-cache events' blocks, where followed (None: learned from traffic alone).
            "event_blocks": len(held.token_keys) if held.block_tokens else None,
            "block_tokens": held.block_tokens if 0 < held.block_tokens != FOLLOWED_EMPTY else None,
            "full_report": held.report_full,  # newly subscribed: its prefills ask it to re-announce reused blocks
        }
