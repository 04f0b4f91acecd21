"""What a producer policy is (docs/behaviour.md "Placement"): one interface, whatever rule orders the producers.

A policy orders the candidate producers of one placement and says why each is where it is (the
``producer_choice`` label of the access log). It asks for what it needs once, at construction
(:attr:`Policy.wants_key`: the prompt's affinity key; :attr:`Policy.wants_blocks`: its prefix
block keys; :attr:`Policy.wants_holdings`: the holdings region), and reads everything else from
the :class:`Asked` of the placement. The policies are :mod:`.least_loaded`, :mod:`.affinity` and
:mod:`.held`; :mod:`.registry` names them, and a new one is its module and one line there.

Saturation is one rule applied once, before any policy (:func:`split_saturated`): a producer at
``placement.kv_saturated`` KV usage is tried only after every other, unless the policy keeps it
(``held`` keeps a saturated producer that holds the prompt's first block or is its home: a hit
shares the blocks); when every candidate is saturated the policy orders them all and the choice
is ``saturated``. The producers set aside are tried last, least loaded first
(``pair.Placement``, which asks the policy).

Invariants, and why:

* Pure: no I/O, no clock, no shared state; counts, readings, holdings, hashes and the randomness
  come in through :class:`Asked`, so a policy is judged offline (``perf.scarce_sim``) exactly as
  it runs.
* The request path has no branch for any policy: it asks the policy what it wants.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from narwhal.fleet import Engine
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.fleet.placement.holdings_source import HoldingsSource
from narwhal.fleet.placement.load import Loads
from narwhal.settings import PlacementSettings

Candidate = tuple[Engine, tuple[Engine, ...]]  # a producer and its permitted consumers
Choice = Callable[[int, Engine], str]  # (position in the order, producer) -> producer_choice
Facts = tuple[int, int, int]  # (matched, uncached, queued) characters: policy held's, else none


def producer_index(candidate: Candidate) -> int:
    """The engine index of a candidate's producer (what per-engine figures are indexed by)."""
    return candidate[0].index


@dataclass(slots=True)
class Asked:
    """One placement's question to a policy: everything it may read, none of it shared."""

    load: Callable[[Candidate], Any]  # a candidate's prefill load (this host's legs, reported load)
    loads: Loads | None  # the engines' fresh readings; None when load reads are off
    key: int | None  # the prompt's affinity key (policies that want it)
    blocks: PrefixBlocks | None  # the prompt's prefix blocks (policies that want them)
    hashes: Sequence[int]  # per engine index, its name's rendezvous hash
    holdings: HoldingsSource | None  # what each producer holds (policies that want it)
    rng: random.Random
    settings: PlacementSettings


@dataclass(slots=True)
class Ordered:
    """The producers in the order to try them, each one's label, and (``held``) its facts."""

    candidates: list[Candidate]
    choice: Choice
    facts: list[Facts] = field(default_factory=list)


class Policy(Protocol):
    """A producer policy: what it wants of the request, and the order it gives."""

    name: str
    wants_key: bool  # the prompt's affinity key (``request.affinity``)
    wants_blocks: bool  # the prompt's prefix block keys (docs/behaviour.md "Placement")
    wants_holdings: bool  # the holdings region and the prefill reports that feed it

    def keeps_saturated(self, asked: Asked) -> Callable[[Candidate], bool] | None:
        """Which saturated candidates stay among the others (None: none do)."""

    def order(self, candidates: list[Candidate], asked: Asked) -> Ordered:
        """``candidates`` (none set aside for saturation) in the order to try them."""


def split_saturated(
    candidates: list[Candidate], loads: Loads | None, keeps: Callable[[Candidate], bool] | None,
) -> tuple[list[Candidate], list[Candidate], bool]:
    """(the candidates the policy orders, those tried last, whether every one is saturated)."""
    if loads is None or not loads.any_saturated or not candidates:
        return candidates, [], False
    full = loads.saturated
    if all(full[c[0].index] for c in candidates):
        return candidates, [], True
    front: list[Candidate] = []
    rest: list[Candidate] = []
    for c in candidates:
        (rest if full[c[0].index] and (keeps is None or not keeps(c)) else front).append(c)
    return front, rest, False


def saturated(position: int, producer: Engine) -> str:
    """Every candidate was saturated: saturation told them apart no more."""
    return "saturated"


def by_load(position: int, producer: Engine) -> str:
    """Chosen by load alone."""
    return "least_loaded"


def by_affinity(position: int, producer: Engine) -> str:
    """The key's favourite (a lone candidate is)."""
    return "affinity"
