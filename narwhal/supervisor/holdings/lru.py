"""The holdings model's per-report LRU steps (``supervisor.holdings``), with less work per block.

A completed prefill's report carries its prompt's block keys (a 4,000-character system prompt
has 16, ``max_prefix_chars`` allows 256): the model asks how many leading ones were held when
it started (:func:`leading`), makes them all the most recently used (:func:`touch`) and marks
the ones it hit as reused (:func:`reused`). Key by key that is three ``OrderedDict`` steps per
block for every request (perf/RESULTS.md "Figures behind the code's choices" has its cost). A
producer's traffic mostly repeats a prefix (a tenant's system prompt): the run of blocks its
last prefill hit (``hot_head``) is then the next one's too, and is kept whole —

* :func:`reused` of the same run again only changes the run's one time (``hot_head_at``),
  written into its keys' entries when anything else changes ``hot`` (:func:`settle`);
* :func:`leading` takes the run as held at once when the prompt starts with it and every key
  of it was there before the prefill started (the latest first time, computed once per run);
* :func:`touch` of the very same prompt again (``head``) moves nothing: it already leads the order.

Invariants, and why:

* The same order, times and counts as the per-key loops (``tests/unit/supervisor/
  test_holdings_lru.py`` holds them equal on random sequences of prompts, evictions, trims and
  ageing): the model's evictions and the order it publishes depend on them.
* ``head``: the last prompt touched, its keys the newest entries of ``keys`` head last;
  ``hot_head``: the last run reused, the newest entries of ``hot`` in prompt order, each
  really reused at ``hot_head_at``. Whatever removes keys calls :func:`drop` first, which
  writes the run's time and forgets both (hot ⊆ keys: a key that goes goes from both).
* A prompt's keys are distinct (a chained 64-bit hash: block k's key covers blocks 0..k).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import repeat
from typing import Protocol


class Lru(Protocol):
    """A producer's holdings as these steps use them (``supervisor.holdings.producer.ProducerHoldings``)."""

    keys: OrderedDict[int, float]  # least recently used first, each with its first time
    hot: OrderedDict[int, float]  # reused lately, least recently reused first, each with when
    head: tuple[int, ...]
    hot_head: tuple[int, ...]
    hot_head_at: float
    hot_head_since: float | None  # the latest first time of hot_head's keys (None: not yet computed)
    hot_stale: bool  # hot_head's entries in ``hot`` still carry an older time than hot_head_at


def leading(p: Lru, keys: tuple[int, ...], started: float) -> int:
    """The leading blocks held when a prefill started: one computed by a prefill that finished
    later was still being computed then, and vLLM (like the fake) hits only finished blocks."""
    held, n = p.keys, 0
    run = p.hot_head
    if run and keys[: len(run)] == run:  # the prefix the last prefill hit: held (hot ⊆ keys)
        since = p.hot_head_since
        if since is None:
            since = p.hot_head_since = max(map(held.__getitem__, run))
        if since <= started:
            n = len(run)
    for key in keys[n:]:
        at = held.get(key)
        if at is None or at > started:
            break
        n += 1
    return n


def touch(p: Lru, keys: tuple[int, ...], at: float) -> None:
    """The prompt's keys now the most recently used, its head the most recent of all (vLLM
    frees a request's blocks tail first); a key already held keeps its first time."""
    if keys == p.head:  # the same prompt as the last: already so
        return
    held = p.keys
    for key in reversed(keys):
        if key in held:
            held.move_to_end(key)  # it keeps its first time: it was there all along
        else:
            held[key] = at
    p.head = keys


def reused(p: Lru, run: tuple[int, ...], at: float) -> None:
    """The keys a prefill hit (``run``, the prompt's head) reused at ``at``: the most recently
    reused, in prompt order."""
    if run == p.hot_head:  # the newest entries already, in this order: only their time moves
        p.hot_head_at, p.hot_stale = at, True
        return
    settle(p)
    hot = p.hot
    for key in run:
        hot[key] = at
        hot.move_to_end(key)
    p.hot_head, p.hot_head_at, p.hot_head_since = run, at, None


def hot_count(p: Lru, stale: float) -> int:
    """Keys reused at or after ``stale``; older ones stop counting as live and go."""
    hot, run = p.hot, len(p.hot_head)
    while len(hot) > run:  # before the last run: each entry's own time
        key, at = next(iter(hot.items()))
        if at >= stale:
            return len(hot)
        del hot[key]
    if hot and p.hot_head_at < stale:  # only the last run is left, reused at its one time
        hot.clear()
        p.hot_head, p.hot_stale = (), False
    return len(hot)


def settle(p: Lru) -> None:
    """Write the last run's time into its entries of ``hot`` (before anything else changes it)."""
    if p.hot_stale:
        p.hot.update(zip(p.hot_head, repeat(p.hot_head_at), strict=False))
        p.hot_stale = False


def drop(p: Lru) -> None:
    """Before keys are removed (an eviction, a trim, a restart): settle, and keep no run or head."""
    settle(p)
    p.head = p.hot_head = ()
    p.hot_head_since = None
