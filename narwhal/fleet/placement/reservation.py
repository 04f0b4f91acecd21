"""Phase slots: the in-flight counts placement reads and the reservation an attempt holds.

Invariant: every slot reserved is released exactly once, however the attempt ends:
:class:`Reservation` makes releasing idempotent, so cleanup code can simply release
everything in ``finally``. A local decode (docs/behaviour.md "Placement") holds a decode slot only: its
``producer`` is its consumer, for naming and reports, and no prefill slot was ever taken.

A pair's decode slot is taken with its prefill's, before the prefill runs, and counted as
*unsent* until its leg goes to the consumer (:meth:`Reservation.decode_sent`) or the slot is
released: the consumer cannot count a request it has not seen, so the load reader must not take
it out of the consumer's own report (docs/behaviour.md "Placement"). Taking it out made a consumer busy elsewhere
look idle exactly while prefills for it ran.

Counts live behind :class:`InflightCounts`: in a gunicorn worker the fleet-wide shared-memory
counts of :class:`narwhal.shm.worker.WorkerFleetState`, elsewhere this process's own
(:class:`LocalInflight`); the policy is the same.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from narwhal.fleet import Engine

PhaseName = Literal["prefill", "decode"]


class InflightCounts(Protocol):
    """The in-flight legs per engine and phase placement counts by: shared memory or local."""

    def totals(self, phase: PhaseName) -> list[int]:
        """Legs in ``phase`` per engine index, to rank candidates by."""

    def both_totals(self) -> tuple[list[int], list[int]]:
        """(prefill, decode) per engine index in one read, for a choice that weighs both."""

    def count(self, engine: Engine, phase: PhaseName) -> int:
        """Legs in ``phase`` on ``engine`` now."""

    def try_reserve(self, engine: Engine, phase: PhaseName, cap: int | None) -> bool:
        """Take a slot unless ``engine`` already has ``cap`` (None: no cap); True if taken."""

    def release(self, engine: Engine, phase: PhaseName) -> None:
        """Give back one slot taken by :meth:`try_reserve`; exactly once per slot."""

    def unsent_decode(self, engine: Engine, delta: int) -> None:
        """Count ``delta`` reserved decodes not yet sent, which the consumer's report cannot include."""


class LocalInflight:
    """This worker's in-flight legs per engine and phase."""

    def __init__(self, size: int) -> None:
        self._counts: dict[str, list[int]] = {"prefill": [0] * size, "decode": [0] * size}
        self.unsent = [0] * size  # no load reader here: kept for what a test wants to see

    def totals(self, phase: PhaseName) -> list[int]:
        """Legs in ``phase`` per engine index: the live list, not a copy."""
        return self._counts[phase]

    def both_totals(self) -> tuple[list[int], list[int]]:
        """(prefill, decode) per engine index: the live lists."""
        return self._counts["prefill"], self._counts["decode"]

    def count(self, engine: Engine, phase: PhaseName) -> int:
        """Legs in ``phase`` on ``engine`` now."""
        return self._counts[phase][engine.index]

    def try_reserve(self, engine: Engine, phase: PhaseName, cap: int | None) -> bool:
        """Take a slot unless ``cap`` is reached; check and take are atomic (one thread, no await)."""
        counts = self._counts[phase]
        if cap is not None and counts[engine.index] >= cap:
            return False
        counts[engine.index] += 1
        return True

    def release(self, engine: Engine, phase: PhaseName) -> None:
        """Give back one slot; not idempotent (:class:`Reservation` makes it so)."""
        self._counts[phase][engine.index] -= 1

    def unsent_decode(self, engine: Engine, delta: int) -> None:
        """Kept only for tests to see: there is no load reader in this process."""
        self.unsent[engine.index] += delta


class _Releaser(Protocol):
    inflight: InflightCounts

    def _release(self, engine: Engine, phase: PhaseName) -> None: ...

    def released(self, resv: Reservation) -> None:
        """The reservation's prefill slot was given back: its policy hears of it (``Policy.released``)."""

    def prefilled(self, resv: Reservation, result: Any) -> None:
        """The reservation's prefill answered: its policy hears of it (``Policy.prefilled``)."""

    def decoded(self, resv: Reservation, at: float) -> None:
        """The reservation's decode completed: its policy hears of it (``Policy.decoded``)."""


class Reservation:
    """The slots of one attempt; each released exactly once.

    ``choice`` says why this producer (``narwhal_placements_total{producer_choice}``):
    ``affinity``, ``affinity_overflow``, ``least_loaded``, ``saturated``, ``held``,
    ``rendezvous``, or ``local`` for a local decode, which chose no producer at all."""

    __slots__ = ("producer", "consumer", "choice", "crossed", "local", "note", "report_full", "_placement",
                 "_prefill_held", "_decode_held", "_unsent")

    def __init__(
        self, placement: _Releaser, producer: Engine, consumer: Engine, choice: str = "least_loaded",
        *, local: bool = False,
    ) -> None:
        self.producer = producer
        self.consumer = consumer
        self.choice = choice
        # Plain fields, not properties: the request path reads them several times per attempt.
        self.crossed = producer is not consumer  # the KV crosses to another engine (not same-worker)
        self.local = local  # a local decode: no producer chosen, no prefill slot
        # The placement policy's, set when the pair was reserved (``Policy.placed``), read by it
        # alone: the request path carries it (None: the policy keeps nothing of this reservation).
        self.note: Any = None
        # Its prefill asks the producer to re-announce the blocks it reuses (vLLM's
        # kv_cache_report_mode "full"): the policy says so while the producer's events are newly followed.
        self.report_full = False
        self._placement = placement
        self._prefill_held = not local
        self._decode_held = True
        self._unsent = not local  # a local decode's leg goes out at once
        if self._unsent:
            placement.inflight.unsent_decode(consumer, 1)

    def decode_sent(self) -> None:
        """The decode leg goes to the consumer now: from here on the consumer counts it."""
        if self._unsent:
            self._unsent = False
            self._placement.inflight.unsent_decode(self.consumer, -1)

    def prefilled(self, result: Any) -> None:
        """Its prefill answered (a ``policy.PrefillFacts``): the policy that keeps its note hears of it."""
        if self.note is not None:
            self._placement.prefilled(self, result)

    def decoded(self, at: float) -> None:
        """Its decode completed at ``at`` (monotonic): the policy that keeps its note hears of it."""
        if self.note is not None:
            self._placement.decoded(self, at)

    def release_prefill(self) -> None:
        """Give back the prefill slot (its policy told, when it keeps a note); idempotent."""
        if self._prefill_held:
            self._prefill_held = False
            if self.note is not None:
                self._placement.released(self)
            self._placement._release(self.producer, "prefill")

    def release_decode(self) -> None:
        """Give back the decode slot (clearing its unsent count) when the decode ends; idempotent."""
        if self._decode_held:
            self._decode_held = False
            if self._unsent:  # never sent (the attempt ended first): no longer unsent either
                self.decode_sent()
            self._placement._release(self.consumer, "decode")

    def release(self) -> None:
        """Give back whatever is still held, for ``finally``; idempotent."""
        if self._prefill_held:  # usually given back already, when the prefill ended
            self.release_prefill()
        self.release_decode()
