"""Choosing the one engine a passthrough request goes to, and holding its slot (docs/behaviour.md "The other P/D
endpoints").

``/tokenize``, ``/v1/embeddings``, ``/score``, ``/rerank`` … need no prefill and no handoff: one
engine that serves the model answers them. Which one, and why:

* **consumers first.** An engine that can decode (role ``consumer`` or ``both``) is taken
  before a producer: producers' time is the fleet's prefill capacity, which every P/D request
  waits on. A producer gets a passthrough request only when no consumer serving the model can
  take it now (out, quarantined, or at its cap).
* **least loaded** within a tier, by the fleet-wide in-flight count of the phase the engine
  serves in (decode for an engine that can decode, prefill for a producer) plus, where fresh,
  what the engine reports running and waiting beyond this host's legs (docs/behaviour.md "Placement", the same
  figures placement weighs), ties at random. :func:`choose` is that rule alone, over the
  counts it is given.
* **a slot while it runs.** The request holds one in-flight slot of that same phase
  (:class:`EngineSlot`), so placement of P/D pairs and the next passthrough see it, and
  ``max_inflight_decode`` / ``max_inflight_prefill`` bound it like any leg; released once,
  however the request ends.
* admission as placement's (:mod:`narwhal.fleet.placement`): engines out (ejected, probing,
  draining) never; quarantined ones only when no other can take it, the one whose quarantine
  ends first first. Pure: :meth:`SingleEngine.try_reserve` reserves now or says no; the bounded
  wait for a free slot (``placement.queue_timeout_s``, ``placement.max_queue``, then 503
  ``no_engine``) awaits, and lives in ``narwhal.request.slot_wait``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from narwhal.fleet.placement import PhaseName, Placement
from narwhal.fleet.roster import Engine


def serving_phase(engine: Engine) -> PhaseName:
    """The phase whose slot a passthrough request holds on ``engine`` (and whose streak it moves)."""
    return "decode" if engine.can_decode else "prefill"


def _has_room(engine: Engine, prefills: Sequence[int], decodes: Sequence[int]) -> bool:
    if engine.can_decode:
        cap, held = engine.max_inflight_decode, decodes[engine.index]
    else:
        cap, held = engine.max_inflight_prefill, prefills[engine.index]
    return cap is None or held < cap


def choose(
    engines: Sequence[Engine],
    usable: Callable[[Engine], bool],
    prefills: Sequence[int],
    decodes: Sequence[int],
    rng: random.Random,
    rank: Callable[[Engine], Any] | None = None,
    extra: Sequence[float] | None = None,
) -> list[Engine]:
    """The engines to try, best first: usable ones with room, consumers before producers, each
    tier by ``rank`` (unreachable, then quarantine left, when given) then in-flight count of its phase, ties at
    random. Pure: counts are indexed by ``Engine.index``."""
    ordered: list[Engine] = []
    for consumers in (True, False):
        tier = [e for e in engines if e.can_decode is consumers and usable(e) and _has_room(e, prefills, decodes)]
        rng.shuffle(tier)  # random tie-break under the stable sort

        def load(e: Engine) -> tuple[Any, float]:
            held = decodes[e.index] if e.can_decode else prefills[e.index]
            return (rank(e) if rank is not None else 0.0, held + (extra[e.index] if extra is not None else 0.0))

        tier.sort(key=load)
        ordered.extend(tier)
    return ordered


class EngineSlot:
    """The one in-flight slot a passthrough request holds; released exactly once."""

    __slots__ = ("engine", "phase", "_placement", "_held")

    def __init__(self, placement: Placement, engine: Engine, phase: PhaseName) -> None:
        self.engine = engine
        self.phase = phase
        self._placement = placement
        self._held = True

    def release(self) -> None:
        """Give the slot back, once; later calls do nothing. Wakes waiters for pairs too."""
        if self._held:
            self._held = False
            self._placement._release(self.engine, self.phase)  # wakes pair waiters too


class SingleEngine:
    """Reserve one engine for a passthrough request, over the placement's view and counts."""

    def __init__(self, placement: Placement, rng: random.Random | None = None) -> None:
        self.placement = placement
        self._rng = rng or random.Random()
        self._by_model: dict[str, tuple[Engine, ...]] = {}
        self._version = -1

    def _serving(self, model: str) -> tuple[Engine, ...]:
        fleet = self.placement.fleet
        if self._version != fleet.version:
            self._by_model.clear()
            self._version = fleet.version
        found = self._by_model.get(model)
        if found is None:
            found = self._by_model[model] = tuple(e for e in fleet.engines if model in e.models)
        return found

    def try_reserve(self, model: str) -> EngineSlot | None:
        """A slot on an engine serving ``model``, least loaded first (quarantined only if no other); None: none free."""
        placement, view = self.placement, self.placement.view
        engines = self._serving(model)
        prefills, decodes = placement.inflight.both_totals()
        loads = placement.current_loads()
        extra = None if loads is None else loads.extra
        order = choose(engines, view.admitted, prefills, decodes, self._rng, extra=extra)
        if not order and view.any_avoided():  # quarantined, then unreachable ones last (docs/behaviour.md "Recovery")
            rank = {e.index: (view.unreachable(e), view.quarantine_left(e)) for e in engines}
            order = choose(engines, view.placeable, prefills, decodes, self._rng, lambda e: rank[e.index], extra)
        for engine in order:
            phase = serving_phase(engine)
            cap = engine.max_inflight_decode if phase == "decode" else engine.max_inflight_prefill
            if placement.inflight.try_reserve(engine, phase, cap):
                return EngineSlot(placement, engine, phase)
        return None
