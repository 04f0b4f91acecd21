"""Choosing a producer and a consumer together, and holding both phase slots (SPEC §3 step 2, §5).

Invariants, and why:

* P and D are chosen *before* the prefill and both slots are reserved at once, so no handoff
  is ever produced that no consumer can take. Each slot is released when its leg ends, however
  it ends; :class:`Reservation` makes releasing idempotent so cleanup code can simply release
  everything in ``finally``.
* An engine that is *out* (ejected, probing, draining) is never chosen. A *quarantined* one
  (the supervisor's QUARANTINED state, or this worker's own quarantine after a failure it saw)
  is chosen only when no pair of engines that are not quarantined can take the request; then
  quarantine is ignored, the engine whose quarantine ends first first (SPEC §5). Quarantine
  steers traffic away; it must never empty a role, because a fault that follows requests (a
  prompt every engine fails on) quarantines every engine in turn, and treating quarantine as
  ejection would then answer clean requests 503 ``no_engine`` on a healthy fleet (issue 16).
* The normal path — nothing quarantined — costs what it did before quarantine was soft: one
  pass over the candidates asking :meth:`FleetView.admitted`, no extra per-candidate work, no
  lock, no IPC. The second pass runs only when the first found nothing and the view says some
  engine may be quarantined.

Counts live behind :class:`InflightCounts`: in a gunicorn worker the fleet-wide shared-memory
counts of :class:`narwhal.shm.worker.WorkerFleetState`, elsewhere this process's own
(:class:`LocalInflight`); the policy is the same.

Policy: least in-flight, ties broken at random. A request waits for a pair up to
``placement.queue_timeout_s`` (and never past its deadline), with at most
``placement.max_queue`` requests waiting on this worker; then 503 ``no_engine``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any, Literal, Protocol

from narwhal.errors import PlacementError
from narwhal.fleet import Engine, Fleet, FleetView
from narwhal.settings import PlacementSettings

PhaseName = Literal["prefill", "decode"]
Candidate = tuple[Engine, tuple[Engine, ...]]  # a producer and its permitted consumers

# While waiting for a pair, re-check at least this often: slots freed by other processes
# (and models discovered late) do not wake this worker's waiters.
_POLL_S = 0.05


class InflightCounts(Protocol):
    def totals(self, phase: PhaseName) -> list[int]: ...
    def both_totals(self) -> tuple[list[int], list[int]]: ...  # (prefill, decode), one read
    def count(self, engine: Engine, phase: PhaseName) -> int: ...
    def try_reserve(self, engine: Engine, phase: PhaseName, cap: int | None) -> bool: ...
    def release(self, engine: Engine, phase: PhaseName) -> None: ...


class LocalInflight:
    """This worker's in-flight legs per engine and phase."""

    def __init__(self, size: int) -> None:
        self._counts: dict[str, list[int]] = {"prefill": [0] * size, "decode": [0] * size}

    def totals(self, phase: PhaseName) -> list[int]:
        return self._counts[phase]

    def both_totals(self) -> tuple[list[int], list[int]]:
        return self._counts["prefill"], self._counts["decode"]

    def count(self, engine: Engine, phase: PhaseName) -> int:
        return self._counts[phase][engine.index]

    def try_reserve(self, engine: Engine, phase: PhaseName, cap: int | None) -> bool:
        counts = self._counts[phase]
        if cap is not None and counts[engine.index] >= cap:
            return False
        counts[engine.index] += 1
        return True

    def release(self, engine: Engine, phase: PhaseName) -> None:
        self._counts[phase][engine.index] -= 1


class Reservation:
    """The two slots of one attempt; each released exactly once."""

    __slots__ = ("producer", "consumer", "detached", "_placement", "_prefill_held", "_decode_held")

    def __init__(self, placement: Placement, producer: Engine, consumer: Engine) -> None:
        self.producer = producer
        self.consumer = consumer
        self.detached = False  # True once a background task owns the release
        self._placement = placement
        self._prefill_held = True
        self._decode_held = True

    @property
    def crossed(self) -> bool:
        return self.producer is not self.consumer

    def release_prefill(self) -> None:
        if self._prefill_held:
            self._prefill_held = False
            self._placement._release(self.producer, "prefill")

    def release_decode(self) -> None:
        if self._decode_held:
            self._decode_held = False
            self._placement._release(self.consumer, "decode")

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()


class Placement:
    def __init__(
        self,
        fleet: Fleet,
        view: FleetView,
        inflight: InflightCounts,
        settings: PlacementSettings,
        rng: random.Random | None = None,
    ) -> None:
        self.fleet = fleet
        self.view = view
        self.inflight = inflight
        self.settings = settings
        self._rng = rng or random.Random()
        self._freed = asyncio.Event()
        self.waiting = 0
        self._by_model: dict[str, tuple[Candidate, ...]] = {}
        self._version = -1

    def try_place(self, model: str, avoid: frozenset[str] = frozenset()) -> Reservation | None:
        """Reserve the least-loaded permitted pair serving ``model`` now, or return None.

        Engines not quarantined first; quarantined ones only when those cannot take it."""
        found = self._pick(model, avoid, None)
        if found is None and self.view.any_quarantined():
            found = self._pick(model, avoid, self._quarantine_rank())
        return found

    def _pick(self, model: str, avoid: frozenset[str], rank: Callable[[Engine], float] | None) -> Reservation | None:
        """One pass. The first (``rank`` None): engines admitted, by load. The second: engines
        placeable, by quarantine left (``rank``), then load."""
        inflight = self.inflight
        # One read of the (fleet-wide) counts per placement, not one per comparison.
        prefills, decodes = inflight.both_totals()
        # The keys are built inline: a helper returning them cost one more call per placement,
        # ~1.2 k of its ~78 k instructions (callgrind), on a path every request takes.
        producer_key: Callable[[Candidate], Any]
        consumer_key: Callable[[Engine], Any]
        if rank is None:
            usable = self.view.admitted
            producer_key = lambda c: prefills[c[0].index]  # noqa: E731
            consumer_key = lambda e: decodes[e.index]  # noqa: E731
        else:
            usable = self.view.placeable
            producer_key = lambda c: (rank(c[0]), prefills[c[0].index])  # noqa: E731
            consumer_key = lambda e: (rank(e), decodes[e.index])  # noqa: E731
        candidates = [
            (p, consumers)
            for p, consumers in self._candidates(model)
            if (not avoid or p.name not in avoid) and usable(p)
        ]
        if len(candidates) > 1:
            self._rng.shuffle(candidates)  # random tie-break under the stable sort below
            candidates.sort(key=producer_key)
        for p, serving in candidates:
            if p.max_inflight_prefill is not None and prefills[p.index] >= p.max_inflight_prefill:
                continue
            consumers = [
                d
                for d in serving
                if (not avoid or d.name not in avoid) and usable(d)
                and (d.max_inflight_decode is None or decodes[d.index] < d.max_inflight_decode)
            ]
            if not consumers:
                continue
            if len(consumers) > 1:
                self._rng.shuffle(consumers)
                d = min(consumers, key=consumer_key)
            else:
                d = consumers[0]
            if not inflight.try_reserve(p, "prefill", p.max_inflight_prefill):
                continue
            if not inflight.try_reserve(d, "decode", d.max_inflight_decode):
                inflight.release(p, "prefill")
                continue
            return Reservation(self, p, d)
        return None

    def _quarantine_rank(self) -> Callable[[Engine], float]:
        """Seconds of quarantine left per engine, read once per pass. Not quarantined is 0.0,
        so such an engine sorts before every quarantined one (and ties one whose quarantine
        is just ending, which then is as good as over)."""
        left = [self.view.quarantine_left(e) for e in self.fleet.engines]
        return lambda e: left[e.index]

    def _candidates(self, model: str) -> tuple[Candidate, ...]:
        """Every producer serving ``model`` with its permitted consumers serving it: fixed
        until an engine's models change, so built once per model rather than per request."""
        if self._version != self.fleet.version:
            self._by_model.clear()
            self._version = self.fleet.version
        found = self._by_model.get(model)
        if found is None:
            found = tuple(
                (p, tuple(d for d in p.permitted_consumers if model in d.models))
                for p in self.fleet.engines
                if p.can_prefill and model in p.models
            )
            self._by_model[model] = found
        return found

    def has_pair(self, model: str) -> bool:
        """Is there a placeable, role-permitted pair for ``model`` (ignoring load)?

        Quarantined engines count: placement uses them when nothing else can take a request,
        so a fleet whose every engine is quarantined still serves, and ``/ready`` (which asks
        this) stays true, and a request waits for a reservation rather than being refused at
        once. Only engines that are out (ejected, probing, draining) make a model unservable."""
        placeable = self.view.placeable
        for p in self.fleet.engines:
            if p.can_prefill and model in p.models and placeable(p):
                if any(model in d.models and placeable(d) for d in p.permitted_consumers):
                    return True
        return False

    def _place(self, model: str, avoid: frozenset[str]) -> Reservation | None:
        # Avoid the engines that just failed, where others exist.
        found = self.try_place(model, avoid)
        if found is None and avoid:
            found = self.try_place(model)
        return found

    async def reserve(self, model: str, deadline: float, avoid: frozenset[str] = frozenset()) -> Reservation:
        """Wait (bounded) for a pair; raise ``no_engine`` when none frees in time."""
        found = self._place(model, avoid)
        if found is not None:
            return found
        loop = asyncio.get_running_loop()
        retry_after = self.settings.retry_after_s
        if self.waiting >= self.settings.max_queue:
            raise PlacementError("no engine available: the wait queue is full", retry_after_s=retry_after)
        if not self.has_pair(model):
            raise PlacementError(
                f"no engine available for model {model!r}: every engine serving it is out",
                retry_after_s=retry_after,
            )
        give_up = min(loop.time() + self.settings.queue_timeout_s, deadline)
        # The gauge is touched on this slow path only (a request placed at once never waits),
        # and imported here: this module must not pull prometheus_client into the master.
        from narwhal import metrics

        self.waiting += 1
        metrics.REQUESTS_QUEUED.inc()
        try:
            while True:
                remaining = give_up - loop.time()
                if remaining <= 0:
                    raise PlacementError(
                        f"no engine available for model {model!r}: all reservations are in use",
                        retry_after_s=retry_after,
                    )
                freed = self._freed
                try:
                    async with asyncio.timeout(min(remaining, _POLL_S)):
                        await freed.wait()
                except TimeoutError:
                    pass
                found = self._place(model, avoid)
                if found is not None:
                    return found
        finally:
            self.waiting -= 1
            metrics.REQUESTS_QUEUED.dec()

    def _release(self, engine: Engine, phase: PhaseName) -> None:
        self.inflight.release(engine, phase)
        if self.waiting:  # a fresh Event per release costs, and only waiters need one
            freed, self._freed = self._freed, asyncio.Event()
            freed.set()
