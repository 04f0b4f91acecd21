"""Placement (docs/behaviour.md "Placement"): which producer and consumer take a request,
and their slots.

A policy per module behind one interface, the choice pure (no I/O; counts, engine reports,
clock and randomness come in through arguments and protocols):

* :mod:`.pair` — :class:`Placement`: candidates, the two passes (quarantine is soft), caps,
  saturation set aside once, local decode;
* :mod:`.policy` — what a producer policy is (:class:`Policy`), what it is asked, the shared
  saturation filter; :mod:`.registry` — the policies by name (``placement.policy``);
* :mod:`.least_loaded` — fewest requests first, saturated engines last, ties at random (every
  consumer; policy ``least_loaded``);
* :mod:`.affinity` — bounded-load rendezvous hashing of the affinity key (policy ``affinity``);
* :mod:`.held` — policy ``held`` (the default): the producer with the least estimated time to
  handoff, knowing what each holds (docs/behaviour.md "Placement");
* :mod:`.blocks` — the prompt's chained prefix block keys (docs/behaviour.md "Placement"), computed lazily;
* :mod:`.token_blocks` — token block keys: what a prompt's token ids and an engine's KV-cache events are
  compared by (docs/behaviour.md "Placement");
* :mod:`.homes` — the live prefixes' homes, the same in every replica (the supervisor computes them);
* :mod:`.holdings_source` — the holdings as policy ``held`` reads them and reports prefills to them;
* :mod:`.fallback` — the second look when the first found no pair (quarantined, then ejected);
* :mod:`.load` — engine-reported load as placement weighs it (fresh readings only);
* :mod:`.reservation` — in-flight counts and the slots an attempt holds.
"""

from narwhal.fleet.placement.load import LoadReading, Loads, LoadSource
from narwhal.fleet.placement.pair import Placement
from narwhal.fleet.placement.policy import Candidate, Policy
from narwhal.fleet.placement.reservation import InflightCounts, LocalInflight, PhaseName, Reservation

__all__ = [
    "Candidate",
    "InflightCounts",
    "LoadReading",
    "LoadSource",
    "Loads",
    "LocalInflight",
    "PhaseName",
    "Placement",
    "Policy",
    "Reservation",
]
