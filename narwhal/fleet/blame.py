"""The breakers' vocabulary and who a failed attempt counts against (docs/behaviour.md "Recovery" "blame").

The types that cross :mod:`narwhal.supervisor.breaker`'s boundary live here (and are re-exported there):
:class:`State`, :class:`EngineInfo`, :class:`Outcome` in, :class:`ProbePlan` and
:class:`EngineStatus` out. The rest is pure functions and sets, no state machine.

:func:`charges` turns one :class:`Outcome` (a worker's report) into the list of
:class:`Charge` es it causes, given the pending ambiguity sets of :class:`Pending`:

* prefill-leg faults and handoff faults (``invalid_handoff`` whatever the phase) → P, as a
  producer;
* decode faults after the first token → D, as a consumer;
* a decode that could not reach D (``engine_unreachable``: refused, reset before any response,
  unresolvable) → D alone, as a consumer, whatever the rule below says: the producer's handoff
  never met a consumer, so it cannot be what failed;
* same-worker decode faults (P is D) → that engine, as a consumer;
* a *crossed* decode (P is not D) that failed before its first token is ambiguous: the
  producer is remembered in D's pending set and the consumer in P's, then

  - D is charged when D's set spans ≥ 2 producers ("real" evidence against D), or when D has
    at most one *other* permitted producer and P has no real evidence against it;
  - P is charged when P's set spans ≥ 2 consumers, or when P has at most one other permitted
    consumer and D has no real evidence against it.

  Both may be charged by one fault (both have real evidence, or a 1P/1D pairing where nothing
  can tell them apart); neither is charged until one of the conditions holds. The "no real
  evidence on the other side" guard on the single-partner shortcut is what keeps one broken
  producer from ejecting every consumer when the consumers each list only that producer: as
  soon as its handoffs have failed on two consumers, the fault is explained by the producer.
  Faults that were only remembered are not charged retroactively when a set later spans two.

A set is D's (or P's) *current streak* of such faults: it is cleared only when that engine
succeeds in that role (or is readmitted), not when it is charged, so a consumer that keeps
failing with two producers keeps being charged. For P, succeeding means a *crossed* handoff
decoded to completion: its local and same-worker successes hand nothing over.

What a stream decoded to ``[DONE]`` clears depends on what it proved (docs/behaviour.md "Recovery": "a prefill
that merely answered proves nothing about the handoff"). A producer's charge for handing its
KV over (``invalid_handoff``, or a crossed decode explained by P) is a :attr:`Charge.handoff`:

==================  ===================  ==============================================
success             consumer streak      producer streak
==================  ===================  ==============================================
crossed (P ≠ D)     D's                  P's, all of it (and P's pending set)
same-worker (P = D) the engine's         its prefill charges, not its handoff charges
local decode        the engine's         nothing: no prefill ran
==================  ===================  ==============================================

Were a same-worker or local success to clear handoff charges, an engine of role ``both`` whose
crossed handoffs all fail would never be ejected while it serves short prompts itself, and
the consumers it fails on would be charged in its place. A lone ``both`` engine
(no crossed partner) still has its prefill faults forgiven by its own successes.

Permitted partners are counted without the engine itself: a same-worker pair never makes a
crossed decode, so for an engine of role ``both`` whose peers are itself and one producer,
that one producer is its only possible crossed partner.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

RoleName = Literal["producer", "consumer"]

# Reasons that never count, even if a report says ``counts=True`` (belt and braces: docs/behaviour.md "Failure
# semantics",
# "Recovery"), come from the one table of reasons.
from narwhal.reasons import UNCOUNTED_REASONS, Reason  # noqa: E402, F401


class State(enum.IntEnum):
    """Values are those of the ``narwhal_engine_state`` gauge (docs/operations.md "Following a request")."""

    ADMITTED = 0
    QUARANTINED = 1
    EJECTED = 2
    PROBING = 3
    DRAINING = 4
    DEGRADED = 5


@dataclass(frozen=True)
class EngineInfo:
    """What blame needs of an engine: its roles, wave and the pairs configuration permits."""

    name: str
    role: str  # "producer" | "consumer" | "both"
    wave: str | None
    permitted_consumers: frozenset[str]  # by configuration (docs/behaviour.md "Placement")
    permitted_producers: frozenset[str]

    @property
    def roles(self) -> tuple[RoleName, ...]:
        """The breaker roles it is judged in: both for ``both``, else its one."""
        if self.role == "both":
            return ("producer", "consumer")
        return ("producer",) if self.role == "producer" else ("consumer",)


@dataclass(frozen=True)
class Outcome:
    """One finished attempt as a worker reports it."""

    producer: str
    consumer: str
    ok: bool  # decoded to completion ([DONE]): proves the handoff and the stream
    failed_engine: str | None  # the engine the fault was observed on (None when ok / not an engine fault)
    phase: str | None  # "prefill" | "decode": the leg that failed
    reason: str | None  # docs/behaviour.md "The request path" reason
    counts: bool  # False for 4xx/429, client disconnects, client deadlines, handoff_expired
    before_first_token: bool  # for decode faults: failed before the first generated token?
    at: float  # completion time (reports are merged in this order)
    # A local decode (docs/behaviour.md "Placement"): no prefill ran, ``producer`` is the consumer. Its success
    # proves the consumer and nothing about the engine as a producer.
    local: bool = False


@dataclass(frozen=True)
class ProbePlan:
    """What the supervisor must probe an engine with, and as which roles."""

    engine: str
    kind: str  # "health" (GET /health only) or "probe" (lifecycle validation + inference probe)
    as_producer: bool  # a tiny prefill whose descriptor must validate
    as_consumer: bool  # a tiny stream decoded to [DONE]
    producer: str | None  # consumer probe after a crossed-decode failure: the original producer


@dataclass(frozen=True)
class EngineStatus:
    """What /admin/engines and the shared-memory records show."""

    name: str
    state: State
    failure_streak: int
    ejections: int
    quarantined_until: float | None
    last_failure_reason: str | None
    last_failure_at: float | None


@dataclass(frozen=True)
class Charge:
    """One failure counted against one engine in one of its roles."""

    engine: str
    role: RoleName
    # For a consumer charged for a crossed decode that failed before its first token: the
    # producer of that attempt, whose new handoff the consumer's probe must use.
    original_producer: str | None = None
    # A producer's fault in handing its KV to another engine (an unusable descriptor, a crossed
    # decode explained by the producer): only a crossed handoff decoded to completion clears
    # it, not a same-worker success, which proves the prefill but hands nothing over.
    handoff: bool = False


@dataclass
class Pending:
    """The ambiguous crossed pre-first-token faults not yet explained by a success."""

    infos: Mapping[str, EngineInfo]
    # consumer -> producers it failed with; producer -> consumers its handoffs failed on.
    as_consumer: dict[str, set[str]] = field(default_factory=dict)
    as_producer: dict[str, set[str]] = field(default_factory=dict)

    def clear(self, engine: str, role: RoleName | None = None) -> None:
        """Forget the engine's unexplained faults in ``role`` (None: both roles)."""
        if role in (None, "consumer"):
            self.as_consumer.pop(engine, None)
        if role in (None, "producer"):
            self.as_producer.pop(engine, None)

    def resolve(self, producer: str, consumer: str) -> list[Charge]:
        """Remember one ambiguous fault of the pair and say who, if anyone, it is charged to."""
        d_seen = self.as_consumer.setdefault(consumer, set())
        p_seen = self.as_producer.setdefault(producer, set())
        d_seen.add(producer)
        p_seen.add(consumer)
        d_real = len(d_seen) >= 2
        p_real = len(p_seen) >= 2
        d_single = len(self.infos[consumer].permitted_producers - {consumer}) <= 1
        p_single = len(self.infos[producer].permitted_consumers - {producer}) <= 1
        out: list[Charge] = []
        if d_real or (d_single and not p_real):
            out.append(Charge(consumer, "consumer", original_producer=producer))
        if p_real or (p_single and not d_real):
            out.append(Charge(producer, "producer", handoff=True))
        return out


def counted(outcome: Outcome) -> bool:
    """Whether a failed outcome may count against an engine at all."""
    return (
        not outcome.ok
        and outcome.counts
        and outcome.failed_engine is not None
        and outcome.reason not in UNCOUNTED_REASONS
    )


def charges(outcome: Outcome, pending: Pending, is_out: Callable[[str], bool]) -> list[Charge]:
    """The charges one counted failure causes (call only when :func:`counted` is true).

    Engines unknown to ``pending.infos`` (removed by a reload) are never charged. An ambiguous
    fault whose partner is out of service (a late report about an attempt placed before that
    partner's ejection) is explained by the partner and changes nothing.
    """
    p, d, failed = outcome.producer, outcome.consumer, outcome.failed_engine
    known = pending.infos
    assert failed is not None
    if outcome.reason == Reason.INVALID_HANDOFF or outcome.phase == "prefill":
        return [Charge(p, "producer", handoff=outcome.reason == Reason.INVALID_HANDOFF)] if p in known else []
    if outcome.phase == "decode":
        if d not in known:
            return []
        if p == d or not outcome.before_first_token or outcome.reason == Reason.ENGINE_UNREACHABLE:
            return [Charge(d, "consumer")]
        if p not in known or is_out(p) or is_out(d):
            return []
        return pending.resolve(p, d)
    # No phase given: charge the engine the fault was observed on, in the role it played.
    if failed not in known:
        return []
    return [Charge(failed, "producer" if failed == p and p != d else "consumer")]
