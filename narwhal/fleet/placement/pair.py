"""Choosing a producer and a consumer together, and holding both phase slots (docs/behaviour.md
"Placement", "Recovery").

Invariants, and why:

* P and D are chosen *before* the prefill and both slots are reserved at once, so no handoff
  is ever produced that no consumer can take (:mod:`.reservation`).
* An engine that is *out* (ejected, probing, draining) is never chosen. A *quarantined* one
  (the supervisor's QUARANTINED state, or this worker's own quarantine after a failure it saw)
  is chosen only when no pair of engines that are not quarantined can take the request; then
  quarantine is ignored, the engine whose quarantine ends first first (docs/behaviour.md "Recovery"). Quarantine
  steers traffic away; it must never empty a role, because a fault that follows requests (a
  prompt every engine fails on) quarantines every engine in turn, and treating quarantine as
  ejection would then answer clean requests 503 ``no_engine`` on a healthy fleet.
* An *unreachable* engine (its last connection attempt failed, docs/behaviour.md "Recovery") is never in the first
  pass either, and comes last in the second, after ejected engines that are reachable, which
  themselves join only when every placeable engine of their role is unreachable
  (:mod:`.fallback`): being unreachable outweighs load and breaker state.
* The normal path — nothing quarantined — is one pass over the candidates asking
  :meth:`FleetView.admitted`, no lock, no IPC. The second pass runs only when the first found
  nothing and the view says some engine may be avoided (quarantined or unreachable).
* The choice itself is pure (no I/O): counts come through :class:`InflightCounts`, engine
  reports through a :class:`LoadSource`, the clock and the randomness are injected.

Which pair (docs/behaviour.md "Placement"): producers in the policy's order (:mod:`.policy`, by
``placement.policy``), which it gives from the request's note; the consumer least loaded among
the producer's permitted consumers; saturated engines last; ties at random. A local decode
(:meth:`Placement.reserve` with ``local``) reserves a consumer only. With
``load_interval_s = 0`` and no note, this is exactly the least-in-flight choice of before.

Pure: :meth:`Placement.try_place` reserves a pair now or says no. The bounded wait for a pair
(``placement.queue_timeout_s``, never past the deadline, at most ``placement.max_queue``
waiting, then 503 ``no_engine``) awaits, and lives in ``narwhal.request.slot_wait``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from narwhal.fleet import Engine, Fleet, FleetView, compat
from narwhal.fleet.placement import affinity, least_loaded
from narwhal.fleet.placement.fallback import Fallback, fallback, reachable_first
from narwhal.fleet.placement.load import LoadCache, Loads, LoadSource
from narwhal.fleet.placement.policy import (
    Asked,
    Candidate,
    Choice,
    Ordered,
    Policy,
    PrefillFacts,
    producer_index,
    saturated,
    split_saturated,
)
from narwhal.fleet.placement.registry import build
from narwhal.fleet.placement.reservation import InflightCounts, PhaseName, Reservation
from narwhal.settings import PlacementSettings


def _engine_index(engine: Engine) -> int:
    return engine.index


def _producer_of(candidate: Candidate) -> Engine:
    return candidate[0]


# What a consumer that holds the prompt was chosen by (``_pick_holder``): no producer order at all.
_NO_ORDER = Ordered([], lambda position, producer: "consumer_holds")


class Placement:
    """Chooses a (producer, consumer) pair and reserves it, without waiting (docs/behaviour.md "Placement").

    Invariant: a returned :class:`Reservation` holds its pair's phase slots (a local decode: the
    decode slot only) until released; ``None`` means no permitted pair has room now (the caller waits)."""

    def __init__(
        self,
        fleet: Fleet,
        view: FleetView,
        inflight: InflightCounts,
        settings: PlacementSettings,
        rng: random.Random | None = None,
        loads: LoadSource | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: Policy | None = None,
    ) -> None:
        self.fleet = fleet
        self.view = view
        self.inflight = inflight
        self.settings = settings
        self._rng = rng or random.Random()
        self._by_model: dict[str, tuple[Candidate, ...]] = {}
        self._consumers_by_model: dict[str, tuple[Engine, ...]] = {}
        self._version = -1
        self._turn = 0  # the producers asked for token ids take turns (tokenizer)
        # Engine-reported load only when the supervisor reads it: off, no per-request cost.
        self._loads = (
            LoadCache(loads, clock, settings.load_stale_s, settings.kv_saturated)
            if loads is not None and settings.load_interval_s > 0 else None
        )
        self._hashes = fleet.by_index(lambda e: affinity.key_hash(e.name))
        # The producers' order (placement.policy), built with whatever it owns (registry.build).
        self.policy = policy if policy is not None else build(settings)

    def current_loads(self) -> Loads | None:
        """The engines' reported loads still fresh enough to place by; None when load reads are off."""
        return None if self._loads is None else self._loads.current()

    def try_place(
        self, model: str, avoid: frozenset[str] = frozenset(), note: Any = None, local: bool = False,
    ) -> Reservation | None:
        """Reserve a permitted pair (or, ``local``, a consumer) serving ``model`` now, or None;
        ``note``: what the policy's ``prepare`` kept of the request.

        Engines not quarantined first; quarantined ones only when those cannot take it (by the
        fallback's rank, the note unread)."""
        loads = self.current_loads()
        if not local and note is not None and self.settings.skip_prefill_share:
            found = self._pick_holder(model, avoid, note, loads)
            if found is not None:
                return found
        pick = self._pick_local if local else self._pick
        found = pick(model, avoid, None, note, loads)
        if found is None and self.view.any_avoided():
            producers = () if local else [p for p, _ in self._candidates(model)]
            second = fallback(self.view, self.fleet, producers, self._consumers(model))
            found = pick(model, avoid, second, note, loads)
        return found

    def _pick(
        self, model: str, avoid: frozenset[str], second: Fallback | None, note: Any, loads: Loads | None,
    ) -> Reservation | None:
        """One pass. The first (``second`` None): engines admitted, by affinity or load. The
        second: the engines :mod:`.fallback` allows, by its rank, then load."""
        inflight = self.inflight
        # One read of the (fleet-wide) counts per placement, not one per comparison.
        prefills, decodes = inflight.both_totals()
        if loads is not None:
            extra = loads.extra
            prefill_load: Callable[[Candidate], Any] = lambda c: prefills[c[0].index] + extra[c[0].index]  # noqa: E731
            decode_load: Callable[[Engine], Any] = lambda e: decodes[e.index] + extra[e.index]  # noqa: E731
        else:
            prefill_load = lambda c: prefills[c[0].index]  # noqa: E731
            decode_load = lambda e: decodes[e.index]  # noqa: E731
        usable_p: Callable[[Engine], bool] = self.view.admitted
        usable_d: Callable[[Engine], bool] = usable_p
        if second is not None:
            usable_p, usable_d, rank, _ = second
            by_rank_p, by_rank_d = prefill_load, decode_load
            prefill_load = lambda c: (rank(c[0]), by_rank_p(c))  # noqa: E731
            decode_load = lambda e: (rank(e), by_rank_d(e))  # noqa: E731
        candidates = [
            (p, consumers)
            for p, consumers in self._candidates(model)
            if (not avoid or p.name not in avoid) and usable_p(p)
        ]
        last = None if second is None else second.down
        groups = [candidates] if last is None else reachable_first(candidates, _producer_of, last)
        for group in groups:  # reachable producers before unreachable ones, whatever the policy says
            # The fallback's pass orders by its rank, the note unread; the policy still keeps it.
            ordered, choice_of, kept = self._order(group, prefill_load, note if second is None else None, loads)
            for position, (p, serving) in enumerate(ordered):
                if p.max_inflight_prefill is not None and prefills[p.index] >= p.max_inflight_prefill:
                    continue
                consumers = [
                    d
                    for d in serving
                    if (not avoid or d.name not in avoid) and usable_d(d)
                    and (d.max_inflight_decode is None or decodes[d.index] < d.max_inflight_decode)
                ]
                if not consumers:
                    continue
                d = least_loaded.pick(consumers, decode_load, _engine_index, loads, self._rng, last)
                resv = self._reserve(p, d, choice_of(position, p), note, kept, position)
                if resv is not None:
                    return resv
        return None

    def _reserve(
        self, p: Engine, d: Engine, choice: str, note: Any, kept: Ordered, position: int,
    ) -> Reservation | None:
        """Both phase slots of the chosen pair, or None (and neither) when one is taken meanwhile;
        the policy told which of its order it was (``Policy.placed``)."""
        inflight = self.inflight
        if not inflight.try_reserve(p, "prefill", p.max_inflight_prefill):
            return None
        if not inflight.try_reserve(d, "decode", d.max_inflight_decode):
            inflight.release(p, "prefill")
            return None
        resv = Reservation(self, p, d, choice)
        self.policy.placed(resv, note, kept, position)
        return resv

    def _order(
        self, candidates: list[Candidate], load: Callable[[Candidate], Any], note: Any, loads: Loads | None,
    ) -> tuple[list[Candidate], Choice, Ordered]:
        """The producers in the order to try them, and the ``producer_choice`` of each: the
        policy's order (:mod:`.policy`), saturated producers it does not keep after all others.

        When every candidate is saturated, saturation tells them apart no more: the policy's
        order runs among them (a prefix still goes where its blocks are cached, which needs the
        least new KV), and the choice is ``saturated``."""
        policy = self.policy
        asked = Asked(load, loads, note, self._hashes, self._rng, self.settings)
        if loads is not None and loads.any_saturated:  # the usual case has nothing to set aside
            front, rest, every = split_saturated(candidates, loads, policy.keeps_saturated(asked))
        else:
            front, rest, every = candidates, [], False
        ordered = policy.order(front, asked)
        if every:
            return ordered.candidates, saturated, ordered
        if not rest:
            return ordered.candidates, ordered.choice, ordered
        tried_last = least_loaded.order(rest, load, producer_index, None, self._rng)
        within, label = len(front), ordered.choice

        def choice(position: int, producer: Engine) -> str:
            return label(position, producer) if position < within else "least_loaded"

        return ordered.candidates + tried_last, choice, ordered

    def _pick_holder(
        self, model: str, avoid: frozenset[str], note: Any, loads: Loads | None,
    ) -> Reservation | None:
        """A consumer that already holds the prompt (``placement.skip_prefill_share``, by the
        policy: ``Policy.holders``, the most held first), admitted and with a free slot, decodes
        it alone; None: P/D. Consumers that hold as much go least loaded first: a system prompt
        every consumer holds would otherwise send every short question to the first of them."""
        consumers = self._consumers(model)
        share = self.settings.skip_prefill_share
        holders = self.policy.holders(note, consumers, share)
        if len(holders) > 1:  # asked again in load order: the policy keeps that order among equals
            decodes = self.inflight.totals("decode")
            extra = loads.extra if loads is not None else None
            holders = self.policy.holders(note, sorted(consumers, key=lambda e: decodes[e.index] + (
                extra[e.index] if extra is not None else 0)), share)
        for d in holders:
            if (not avoid or d.name not in avoid) and self.view.admitted(d) and self.inflight.try_reserve(
                    d, "decode", d.max_inflight_decode):
                resv = Reservation(self, d, d, "consumer_holds", local=True)
                # Its note too: the policy hears the decode completed (the consumer holds this
                # turn's prompt now, for the next turn), with no producer order to tell of.
                self.policy.placed(resv, note, _NO_ORDER, 0)
                return resv
        return None

    def _pick_local(
        self, model: str, avoid: frozenset[str], second: Fallback | None, note: Any, loads: Loads | None,
    ) -> Reservation | None:
        """A consumer alone, for a local decode (docs/behaviour.md "Placement"): least loaded, saturated last."""
        decodes = self.inflight.totals("decode")
        usable = self.view.admitted if second is None else second.consumer_ok
        rank = None if second is None else second.rank
        extra = loads.extra if loads is not None else None
        consumers = [
            d for d in self._consumers(model)
            if (not avoid or d.name not in avoid) and usable(d)
            and (d.max_inflight_decode is None or decodes[d.index] < d.max_inflight_decode)
        ]

        def load(e: Engine) -> Any:
            value = decodes[e.index] + (extra[e.index] if extra is not None else 0)
            return value if rank is None else (rank(e), value)

        last = None if second is None else second.down
        for d in least_loaded.order(consumers, load, _engine_index, loads, self._rng, last):
            if self.inflight.try_reserve(d, "decode", d.max_inflight_decode):
                return Reservation(self, d, d, "local", local=True)
        return None

    def _refresh(self) -> None:
        if self._version != self.fleet.version:
            self._by_model.clear()
            self._consumers_by_model.clear()
            self._hashes = self.fleet.by_index(lambda e: affinity.key_hash(e.name))
            self._version = self.fleet.version

    def _candidates(self, model: str) -> tuple[Candidate, ...]:
        """Every producer serving ``model`` with its permitted consumers serving it: fixed
        until an engine's models change, so built once per model rather than per request."""
        self._refresh()
        found = self._by_model.get(model)
        if found is None:  # the compatible pairs only (docs/decisions.md "vLLM releases": versions and transfer modes)
            found = tuple(
                (p, tuple(d for d in p.permitted_consumers if model in d.models and compat.compatible(p, d)))
                for p in self.fleet.engines
                if p.can_prefill and model in p.models
            )
            self._by_model[model] = found
        return found

    def _consumers(self, model: str) -> tuple[Engine, ...]:
        """Every engine that can decode ``model`` (a local decode needs no producer)."""
        self._refresh()
        found = self._consumers_by_model.get(model)
        if found is None:
            found = self._consumers_by_model[model] = tuple(
                d for d in self.fleet.engines if d.can_decode and model in d.models
            )
        return found

    def tokenizer(self, model: str) -> Engine | None:
        """An engine to ask for a prompt's token ids (``request.prompt_tokens``): a producer of
        ``model`` that is admitted and reachable, in turn (each engine of a model tokenizes alike);
        None when there is none."""
        view = self.view
        ready = [p for p, _ in self._candidates(model) if view.admitted(p) and not view.unreachable(p)]
        if not ready:
            return None
        self._turn += 1
        return ready[self._turn % len(ready)]

    def has_pair(self, model: str, exclude: frozenset[str] = frozenset()) -> bool:
        """Is there a placeable, role-permitted pair for ``model`` (ignoring load, and the engines
        named in ``exclude``)?

        Quarantined engines count: placement uses them when nothing else can take a request,
        so a fleet whose every engine is quarantined still serves, and ``/ready`` (which asks
        this) stays true, and a request waits for a reservation rather than being refused at
        once. Only engines that are out (ejected, probing, draining) make a model unservable."""
        placeable = self.view.placeable
        for p, consumers in self._candidates(model):
            if placeable(p) and p.name not in exclude and any(
                    placeable(d) and d.name not in exclude for d in consumers):
                return True
        return False

    def unready(self, model: str) -> str | None:
        """Why no request for ``model`` could succeed now, or None: ``/ready``'s rule
        (docs/behaviour.md "Recovery") is a permitted pair whose engines are both in
        service (not ejected, probing or draining; quarantined and degraded ones serve) and
        reachable (an engine whose last connection attempt failed is not)."""
        view = self.view

        def ready(engine: Engine) -> bool:
            return view.placeable(engine) and not view.unreachable(engine)

        candidates = self._candidates(model)
        if any(ready(p) and any(ready(d) for d in consumers) for p, consumers in candidates):
            return None
        if not any(consumers for _, consumers in candidates):
            return self.incompatibility(model) or f"no producer->consumer pair is permitted for model {model!r}"
        engines = {e.name: e for p, consumers in candidates for e in (p, *consumers)}
        down = [f"{name} {'unreachable' if view.placeable(e) else view.why_out(e)}"
                for name, e in sorted(engines.items()) if not ready(e)]
        return f"no producer->consumer pair for model {model!r} is in service and reachable: {', '.join(down)}"

    def incompatibility(self, model: str) -> str | None:
        """Why ``model`` has no pair when engines in service could pair but for their versions or
        transfer modes (docs/decisions.md "vLLM releases": the 503's detail; the compatible ones, if any, are out), else
        None."""
        view = self.view
        if self.has_pair(model):
            return None
        reasons = sorted({compat.why_incompatible(p, d)
                          for p in self.fleet.engines if p.can_prefill and model in p.models and view.placeable(p)
                          for d in p.permitted_consumers
                          if model in d.models and view.placeable(d) and not compat.compatible(p, d)})
        if not reasons:
            return None
        return ("no consumer compatible with a producer: NIXL hands off only between engines of one vLLM "
                "version and transfer mode (" + "; ".join(reasons) + ")")

    def release_consumers(self, producer: Engine, chosen: Engine, model: str, *, chosen_first: bool) -> list[Engine]:
        """Where an undecoded handoff of ``producer`` may be released, in order (docs/behaviour.md "Cleanup"):
        the chosen consumer, then the producer's other permitted consumers that serve ``model``:
        admitted, then quarantined, then ejected by their breaker (a release is one tiny
        non-streaming decode: a consumer ejected for stream faults may still free the blocks,
        and stranding them pins the producer's KV for its whole lease), unreachable ones last;
        the chosen one last instead when it was just found unreachable. A permitted consumer
        shares the producer's connector, so any of them can pull the blocks. Nothing is
        reserved (``narwhal.request.attempt`` says why). Only compatible consumers (docs/decisions.md "vLLM releases"):
        NIXL
        refuses the handshake of any other, and the blocks would stay pinned."""
        view = self.view
        others = [d for d in producer.permitted_consumers
                  if d is not chosen and d is not producer and model in d.models and compat.compatible(producer, d)
                  and (view.placeable(d) or view.ejected_by_breaker(d))]
        # stable: configuration order within each tier
        others.sort(key=lambda d: (view.unreachable(d), not view.placeable(d), not view.admitted(d)))
        return [chosen, *others] if chosen_first else [*others, chosen]

    def servable(self, model: str, local: bool, exclude: frozenset[str] = frozenset()) -> bool:
        """Could a reservation for ``model`` be made once slots free up, ``exclude`` never used?"""
        if local:
            return any(self.view.placeable(d) and d.name not in exclude for d in self._consumers(model))
        return self.has_pair(model, exclude)

    def _place(self, model: str, avoid: frozenset[str], note: Any, local: bool,
               exclude: frozenset[str] = frozenset()) -> Reservation | None:
        # Avoid the engines that just failed, where others exist; never the ones in ``exclude``.
        found = self.try_place(model, avoid | exclude if exclude else avoid, note, local)
        if found is None and avoid:
            found = self.try_place(model, exclude, note, local)
        return found

    def released(self, resv: Reservation) -> None:
        """A reservation with a note gave its prefill slot back: its policy hears of it."""
        self.policy.released(resv)

    def prefilled(self, resv: Reservation, result: PrefillFacts) -> None:
        """A reservation with a note has its prefill's answer: its policy hears of it."""
        self.policy.prefilled(resv, result)

    def decoded(self, resv: Reservation, at: float) -> None:
        """A reservation with a note has its decode completed: its policy hears of it."""
        self.policy.decoded(resv, at)

    def _release(self, engine: Engine, phase: PhaseName) -> None:
        """A slot of this worker is free again (``narwhal.request.slot_wait`` wakes its waiters)."""
        self.inflight.release(engine, phase)


