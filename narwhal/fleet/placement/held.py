"""The ``held`` policy (SPEC §3.3): the producer that will hand off soonest, knowing what each holds.

For each candidate producer: *matched* = the characters of the longest leading run of this
prompt's blocks it is believed to hold (the supervisor's holdings, read from shared memory);
*estimated time to handoff* = (its queued prefill work + this prompt's uncached characters ×
:func:`eviction_weight`) ÷ its prefill rate.
Queued work is its prefill load (this host's in-flight prefill legs plus what
it reports running and waiting that is not ours): this host's legs by their own uncached
characters (summed in shared memory by every worker), the others' requests each reckoned at the
fleet's mean uncached characters per prefill (this prompt's length while none is known). The rate is the
producer's learned one, else the candidates' mean, else 1 (all equal: the estimate is then the
work itself). The least estimate wins; candidates within ``placement.affinity_slack`` of it are
ordered by the rendezvous rank of the prompt's first block key, so workers and replicas that know
nothing yet (every estimate equal) still agree, and a prefix's first prefills all go where its
later ones will look.

Deviation from SPEC §3.3 (README "Placement"), measured on perf's ``prefix_scarce``: counted
once, the uncached part lets a short queue beat a held prefix on every fluctuation, and each
such miss evicts another prefix on a full producer (cached share 0.27, TTFB p50 114 ms against
the ideal's 0.89 and 28 ms). On a full producer it counts three times — the prefill itself, the
prefix it evicts (prefilled again later) and the queue it holds up (0.73, 44 ms). And a
saturated producer (KV usage at ``kv_saturated``) goes last only when it holds none of the
prompt: a scarce KV is always nearly full, and a hit shares the blocks it needs.

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
from typing import Protocol, TypeVar

from narwhal.fleet.placement.affinity import score
from narwhal.fleet.placement.blocks import PrefixBlocks

T = TypeVar("T")

_NOTHING: frozenset[int] = frozenset()
FULL_WEIGHT = 3.0  # a miss on a full producer: its prefill, the prefix it evicts, the queue it holds up


class HeldReading(Protocol):
    """One producer's published holdings (``narwhal.shm.holdings.Held``)."""

    @property
    def keys(self) -> frozenset[int]: ...
    @property
    def blocks(self) -> int: ...
    @property
    def capacity_blocks(self) -> int | None: ...
    @property
    def chars_per_token(self) -> float | None: ...
    @property
    def prefill_chars_per_s(self) -> float | None: ...
    @property
    def mean_uncached_chars(self) -> float: ...


class HoldingsSource(Protocol):
    """Per engine index, the holdings published for it (None: none), and this host's prefill
    work in flight (uncached characters of its prefill legs), which placement adds to and takes
    back as legs start and end."""

    def current(self) -> Sequence[HeldReading | None]: ...
    def work(self) -> Sequence[int]: ...
    def add_work(self, engine: int, chars: int) -> None: ...


def keys_of(readings: Sequence[HeldReading | None], index: int) -> frozenset[int]:
    """The block keys engine ``index`` is believed to hold (none without a reading)."""
    reading = readings[index] if index < len(readings) else None
    return reading.keys if reading is not None else _NOTHING


def matched_blocks(blocks: PrefixBlocks, sets: Sequence[frozenset[int]]) -> list[int]:
    """Per candidate, how many of the prompt's leading blocks it holds; stops at the first
    block no candidate holds."""
    runs = [0] * len(sets)
    count, key = blocks.count, blocks.key
    for i, held in enumerate(sets):
        if held:  # keys are computed as far as the longest run asks, once each (PrefixBlocks)
            run = 0
            while run < count and key(run) in held:
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
) -> tuple[list[T], list[tuple[int, int, int]]]:
    """``items`` in the order to try them, and for each (same order) the characters it matched,
    the prompt's characters it would compute, and the queued work ahead of them. ``ours``: this
    host's in-flight prefill work there, in characters; ``others``: its requests not ours."""
    readings = [held[index(item)] if index(item) < len(held) else None for item in items]
    sets = [_NOTHING if r is None else r.keys for r in readings]
    runs = matched_blocks(blocks, sets)
    width = blocks.block_chars
    prompt = len(blocks.text)
    known = [r.prefill_chars_per_s for r in readings if r is not None and r.prefill_chars_per_s]
    default_rate = sum(known) / len(known) if known else 1.0
    means = [r.mean_uncached_chars for r in readings if r is not None and r.mean_uncached_chars > 0]
    per_request = max(means) if means else float(prompt)
    estimates = []
    facts = []
    for item, reading, run in zip(items, readings, runs, strict=True):
        rate = (reading.prefill_chars_per_s if reading is not None else None) or default_rate
        queued = ours(item) + others(item) * per_request
        uncached = max(prompt - run * width, 0)
        estimates.append((queued + uncached * eviction_weight(reading)) / rate)
        facts.append((run * width, uncached, int(queued)))
    best = min(estimates)
    bound = best * (1 + slack) + 1e-9
    first = blocks.key(0) if blocks.count else 0
    ranked = sorted(
        range(len(items)),
        key=lambda i: (estimates[i] > bound, -score(first, engine_hash(items[i])) if estimates[i] <= bound
                       else estimates[i]),
    )
    return [items[i] for i in ranked], [facts[i] for i in ranked]


def eviction_weight(reading: HeldReading | None) -> float:
    """How many times a candidate's uncached characters count: three times on a producer whose
    KV is full or of unknown size (the prefill, the prefix it evicts, the queue it holds up),
    once where there is room (nothing is evicted)."""
    if reading is None or reading.capacity_blocks is None:
        return FULL_WEIGHT  # unknown capacity: assume full, as a busy cache is
    return FULL_WEIGHT if reading.blocks >= reading.capacity_blocks else 1.0


def choice_label(matched: int, anyone_held: bool) -> str:
    """``producer_choice`` for a producer that matched ``matched`` characters."""
    if matched > 0:
        return "held"
    return "least_loaded" if anyone_held else "rendezvous"
