"""Prefix affinity: the same prompt prefix goes to the same producer (docs/behaviour.md "Placement"); policy
``affinity``.

Rendezvous (highest-random-weight) hashing of (key, engine name), with bounded load: the
candidates are ranked by a hash of the pair, and the first in rank whose prefill load is at
most ``placement.affinity_load_factor`` × the candidates' mean prefill load + 1 is chosen.
While the prefix's favourite producer has room, every worker and every router replica sends
the prefix there, so the engine's prefix cache hits, with no shared state; when it is busy
the prefix spills to its second favourite, not to a random engine; removing an engine moves
only the prefixes it ranked first.

Stable across processes and replicas: the key is hashed with BLAKE2b (never Python's
``hash()``, salted per process), once per request, to 64 bits; each engine's name is hashed
the same way once, when placement is built; the per-engine score is a SplitMix64 finalizer of
the two XORed, a few integer operations per candidate.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

from narwhal.fleet import Engine
from narwhal.fleet.placement import least_loaded
from narwhal.fleet.placement.policy import (
    Asked,
    Candidate,
    KeepsNothing,
    Ordered,
    PromptText,
    by_affinity,
    by_load,
    producer_index,
)
from narwhal.settings import PlacementSettings

T = TypeVar("T")

_MASK = (1 << 64) - 1


def key_hash(text: str) -> int:
    """The 64-bit hash of an affinity key (or of an engine name): the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def score(key: int, engine: int) -> int:
    """The rendezvous weight of an engine (its name's :func:`key_hash`) for a key."""
    x = key ^ engine
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def rank(items: list[T], key: int, engine_hash: Callable[[T], int]) -> list[T]:
    """``items`` in rendezvous order for ``key``: the favourite first."""
    return sorted(items, key=lambda item: score(key, engine_hash(item)), reverse=True)


def bounded_order(
    items: list[T], key: int, engine_hash: Callable[[T], int], load: Callable[[T], float], factor: float
) -> tuple[list[T], int, T]:
    """The order to try producers in, how many lead it by affinity, and the favourite.

    First the candidates within the bound, in rank; then those over it, least loaded first.
    A producer taken from the first part is the ``affinity`` choice when it is the favourite
    (first in rank), else ``affinity_overflow``; one from the second part is ``least_loaded``.
    """
    ranked = rank(items, key, engine_hash)
    loads = [load(item) for item in ranked]
    bound = factor * (sum(loads) / len(loads)) + 1
    within = [item for item, value in zip(ranked, loads, strict=True) if value <= bound]
    over = sorted((pair for pair in zip(ranked, loads, strict=True) if pair[1] > bound), key=lambda pair: pair[1])
    return within + [item for item, _ in over], len(within), ranked[0]


def prompt_key(prompt: PromptText, settings: PlacementSettings) -> int | None:
    """The prompt's affinity key: the hash of its first ``affinity_chars`` characters; None for
    a prompt shorter than ``affinity_min_chars`` or an endpoint without prompt text. At most
    ``affinity_chars`` characters are read, so a 100 KiB prompt costs what a 1 KiB one does."""
    head = prompt(settings.affinity_chars)
    if head is None or len(head) < settings.affinity_min_chars:
        return None
    return key_hash(head)


class Affinity(KeepsNothing):
    """Policy ``affinity``: producers in the bounded-load rendezvous order of the prompt's key
    (its note); least loaded when the prompt has none (shorter than ``affinity_min_chars``)."""

    name = "affinity"

    def __init__(self, settings: PlacementSettings, holdings: object = None) -> None:
        self.settings = settings  # the holdings are not read

    def prepare(self, prompt: PromptText) -> int | None:
        """The prompt's affinity key (:func:`prompt_key`), its note."""
        return prompt_key(prompt, self.settings)

    def keeps_saturated(self, asked: Asked) -> Callable[[Candidate], bool] | None:
        """None: a saturated producer takes no prefix while others have room."""
        return None

    def order(self, candidates: list[Candidate], asked: Asked) -> Ordered:
        """The key's bounded-load order; by load without a key. A lone candidate is the key's favourite."""
        key: int | None = asked.note
        if key is None or len(candidates) < 2:
            ordered = least_loaded.order(candidates, asked.load, producer_index, None, asked.rng)
            return Ordered(ordered, by_load if key is None else by_affinity)
        hashes = asked.hashes
        ordered, within, favourite = bounded_order(
            candidates, key, lambda c: hashes[c[0].index], asked.load, asked.settings.affinity_load_factor)

        def choice(position: int, producer: Engine) -> str:
            if position >= within:
                return "least_loaded"
            return "affinity" if producer is favourite[0] else "affinity_overflow"

        return Ordered(ordered, choice)
