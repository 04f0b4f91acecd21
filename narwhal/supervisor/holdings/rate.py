"""The rate the ``held`` estimate places each producer by (docs/behaviour.md "Placement"): the fleet's learned rate,
at the producer's engine-reported rate class.

Why: a replica learns rates from its own round trips (``supervisor.holdings``), and with more than
one replica those are noisy: "nothing queued ahead" is judged from this replica's view, and the
other replica's requests are queued all the same. In ``perf.scarce_sim`` four equal producers read
74,000-248,000 characters/s by one replica and, in another order, by the other; a home divided by
a rate a third of its peers' loses its requests to a miss elsewhere, and each such miss evicts a
live prefix. The engine's own ``/metrics`` read alike in every replica (``supervisor.holdings.engine_rate``),
and in coarse classes (``homes.rate_class``) they are stable. So the relative rate is the class,
and the scale, which only weighs queued work against a miss's, is this replica's learned rates'
mean over the producers that report one, each taken back to class 1. Measured with
``perf.scarce_sim`` (seeds 0-4, two replicas, cached share): uniform 0.870-0.890 → 0.888-0.893,
Zipf 0.768-0.877 → 0.866-0.884, slow producer 0.829-0.897 → 0.886-0.902; each seed's within 1.5
points of one replica's (before: as many as 12.6 below).

Invariants, and why:

* Pure: rates come in as arguments, per producer in the same order.
* A producer whose engine's ``/metrics`` carry the prefill counters is in class 1 until they
  give a rate (as its homes' room is), so from its first read every replica ranks it alike; one
  whose engine carries none is placed by its own learned rate, else not at all (None: the
  estimate takes the candidates' mean); before this replica has learned any rate, a producer is
  placed at its engine's rate in characters, else not at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from narwhal.fleet.placement.homes import rate_class


def placing_rates(learned: Sequence[float | None], reported: Sequence[float | None], counted: Sequence[bool],
                  chars_per_token: Sequence[float]) -> list[float | None]:
    """Per producer, the rate to place it by (characters/s), from its learned rate (characters/s),
    its engine-reported one (tokens/s; None: none yet), whether its engine's ``/metrics`` carry the
    prefill counters at all (``counted``), and its characters per token."""
    known = [r for r in reported if r]
    fastest = max(known) if known else None
    classes = [rate_class(r, fastest) for r in reported]
    # Only producers counted say what class 1 is: one whose engine says nothing stands for itself.
    at_one = [rate / share for rate, count, share in zip(learned, counted, classes, strict=True) if rate and count]
    scale = sum(at_one) / len(at_one) if at_one else None
    out: list[float | None] = []
    for rate, engine, count, share, cpt in zip(learned, reported, counted, classes, chars_per_token, strict=True):
        if count and scale:
            out.append(scale * share)  # no rate reported yet: class 1, as its homes' room
        elif rate is not None or not engine:
            out.append(rate)
        else:
            out.append(engine * cpt)
    return out
