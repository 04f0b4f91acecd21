"""Homes for the live prefixes (docs/behaviour.md "Placement", README "Placement"): where every replica sends a prefix.

Why: the holdings a replica learns are its own traffic's. Two router replicas with requests
alternating each learn only where *they* put a prefix, so each keeps its own copy on a producer
of its choosing and the two halves of the fleet's traffic evict each other's prefixes (measured
by ``perf.scarce_sim``: 0.25 cached with two replicas against 0.8 with one). What both replicas
do see alike is *which* prefixes are live and how long they are: each sees half of every
prefix's traffic. So each supervisor computes the same assignment of live prefixes to producers
from that alone: the prefixes in order of their first block key, each to the first producer in
its rendezvous rank whose room still takes it (rendezvous hashing with bounded loads, the bound
being KV room instead of requests). A producer's room is its KV capacity less a margin for the
requests' own tails and the blocks running requests pin. Then each producer past its room times
its *rate class* sheds homes, the last assigned first, each to the first producer in its rank
whose class room still takes it; one no other room takes stays where the KV room put it. Placement then
reckons a prefix's home as holding it (``held.order``): every replica sends it there, learns
there that it is held (``under``) and stops keeping a copy of its own elsewhere.

The rate class: a slower producer takes fewer homes, so less of the traffic. Not by the learned
prefill rate: each replica learns its own, from noisy round trips, and rooms that differ by
replica give homes that differ by replica (measured: two replicas 0.55-0.67 cached with rooms
scaled by it, 0.77-0.89 without). By the rate the engine reports on its ``/metrics``
(``supervisor.holdings.engine_rate``), which every replica reads alike, relative to the fastest
producer's, and quantized to halvings (``RATE_CLASSES``: 1, 1/2, 1/4): ratios from 0.65 are
class 1, from 0.25 class 1/2, below that 1/4. The edges sit below the classes' values, not
between them: the reported rate only ever reads *low* (it counts the time a prefill shares the
GPU or waits on it, more on a busier engine, and a slower producer is the busier one;
``supervisor.holdings.engine_rate`` keeps its best recent span for that reason). Measured with
``perf.scarce_sim`` (uniform, Zipf and slow variants, the ratio over time, p1-p95): fast
producers 0.72-1.0, the half-rate one 0.32-0.51; the edges fall in those gaps (a half-rate
producer at rest reads 0.5, inside its class), and two replicas reading a few prefills apart
stay in one class. Finer steps (3/4) would put a fast producer made to look 15 % slower by its
load in another class than its peers, and would change no home there: rooms hold whole
prefixes. A producer without a reported rate yet is in class 1 (today's unscaled room).

Why shed rather than fill by the class rooms: filled by them, a fleet with no spare room (the
slow variant of ``prefix_scarce``: 8 prompts, 4 producers keeping 2 each) leaves a prefix without
a home once the slow producer's class halves, and each replica then places that one by its own
holdings, keeping a copy each; and the class change reorders the greedy fill, moving 6 of 8 homes
mid-run (``perf.scarce_sim``: two replicas 0.72-0.80 cached against one's 0.79-0.88). Shed, a class
change moves only what the slower producer gives up, and only where there is room for it, and
every replica computes the same homes whether or not it has read the rate yet (two replicas
0.83-0.90, one 0.89-0.90).

Invariants, and why:

* Pure and deterministic: the same prefixes, sizes and rooms give the same homes in every
  process (the rendezvous score is :func:`affinity.score`, no salted hash, no clock).
* A prefix no producer's KV room takes has no home (placement falls back to the estimate alone);
  producers of unknown capacity take no homes (nothing bounds them, and a home there would be
  affinity's hot spot again).
* Bounded: at most ``MAX_HOMES`` prefixes, the longest first when there are more.
* Cheap to repeat: the supervisor assigns every 0.1 s. Ranking 4,096 prefixes over 32 producers
  is 131,072 rendezvous scores (tens of milliseconds: perf/RESULTS.md "Figures behind the code's
  choices"); a
  prefix's rank changes only when the producers do, so :class:`Ranks` keeps each one between
  calls and a call scores only the prefixes new since the last (the same homes, measured in
  ``tests/unit/fleet/test_homes.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from narwhal.fleet.placement.affinity import key_hash, score

__all__ = ["FILL", "MAX_HOMES", "RATE_CLASSES", "Ranks", "assign", "key_hash", "rate_class", "room_blocks"]

FILL = 0.9  # of a producer's KV capacity, what homes may take (the rest: tails, pinned blocks)
MAX_HOMES = 4096
# (lowest ratio to the fastest's rate, the share of its room a producer's homes take), fastest first
RATE_CLASSES = ((0.65, 1.0), (0.25, 0.5), (0.0, 0.25))


def rate_class(rate: float | None, fastest: float | None) -> float:
    """The class of ``rate`` relative to ``fastest`` (engine-reported, tokens/s): 1 when either is
    unknown (the room unscaled, as before any rate is reported)."""
    if rate is None or not fastest or rate <= 0:
        return 1.0
    ratio = rate / fastest
    return next(share for lowest, share in RATE_CLASSES if ratio >= lowest)


def room_blocks(capacity_blocks: int | None, rate_share: float = 1.0) -> int:
    """The blocks of homes a producer takes, ``rate_share`` (its rate class) of its room: none of
    unknown capacity."""
    return 0 if capacity_blocks is None else int(capacity_blocks * FILL * rate_share)


class Ranks:
    """Each prefix's rendezvous rank over the producers (indices, best first), kept from one
    :func:`assign` to the next while the producers stay the same (the module's last invariant)."""

    __slots__ = ("_names", "_ranks")

    def __init__(self) -> None:
        self._names: tuple[int, ...] = ()
        self._ranks: dict[int, list[int]] = {}

    def of(self, keys: Sequence[int], names: tuple[int, ...]) -> dict[int, list[int]]:
        """The ranks of ``keys`` over producers named ``names``; only these are kept for next time."""
        if names != self._names:
            self._names, self._ranks = names, {}
        old = self._ranks
        ranks = {}
        for key in keys:
            rank = old.get(key)
            ranks[key] = _rank(key, names) if rank is None else rank
        self._ranks = ranks
        return ranks


def _rank(key: int, names: tuple[int, ...]) -> list[int]:
    return sorted(range(len(names)), key=lambda i: score(key, names[i]), reverse=True)


def assign(prefixes: Sequence[tuple[int, int]], producers: Sequence[tuple[int, int]],
           scaled: Sequence[int] | None = None, ranks: Ranks | None = None) -> dict[int, int]:
    """``prefixes``: (first block key, blocks); ``producers``: (engine name hash, room blocks);
    ``scaled``: per producer, its room at its rate class (default: the room); ``ranks``: the
    ranks kept from the last call (default: none, all scored now). Each prefix's home, as an
    index into ``producers``; prefixes no room takes are left out."""
    if len(prefixes) > MAX_HOMES:
        prefixes = sorted(prefixes, key=lambda p: (-p[1], p[0]))[:MAX_HOMES]
    ordered = sorted(prefixes)
    names = tuple(name for name, _ in producers)
    ranks_of = (ranks or Ranks()).of([key for key, _ in ordered], names)
    used = [0] * len(producers)
    homes: dict[int, int] = {}
    for key, size in ordered:
        for i in ranks_of[key]:
            if used[i] + size <= producers[i][1]:
                used[i] += size
                homes[key] = i
                break
    if scaled is not None:
        _shed(ordered, ranks_of, homes, used, scaled)
    return homes


def _shed(ordered: list[tuple[int, int]], ranks: dict[int, list[int]], homes: dict[int, int], used: list[int],
          scaled: Sequence[int]) -> None:
    """Move homes off each producer past its ``scaled`` room, the last assigned first, each to
    the first producer in its rank whose scaled room still takes it; one no scaled room takes
    stays (its KV has room for it there, and a home every replica computes alike beats none)."""
    for key, size in reversed(ordered):
        at = homes.get(key)
        if at is None or used[at] <= scaled[at]:
            continue
        for i in ranks[key]:
            if i != at and used[i] + size <= scaled[i]:
                used[at] -= size
                used[i] += size
                homes[key] = i
                break
