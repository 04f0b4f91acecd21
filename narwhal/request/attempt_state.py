"""Where an attempt is in its life, and the only ways it may move on (docs/behaviour.md "The request path":
**Placement** to **Cleanup**).

One attempt is one prefill and one decode on a pair placed together. Its life, as a table:

    placed ──► prefilling ──► handed_off ──► decoding ──► streaming ──► done
      │             └──► detached                 └──► done (a whole, non-streaming answer)
      └──► decoding (a local decode: no prefill, no handoff)

    and from every state that has not ended ──► failed

- ``placed``: the pair is reserved (both phase slots held).
- ``prefilling``: the one-token prefill is on the producer.
- ``handed_off``: the producer answered; its descriptor is being checked (docs/behaviour.md "Handoff validation").
- ``decoding``: the decode is on its way to the consumer (a local decode starts here).
- ``streaming``: output reached the client: from here on nothing is retried (docs/behaviour.md "Recovery").
- ``done`` / ``failed``: the attempt ended. ``detached``: the client left mid-prefill and a
  background task owns the reservation and the handoff (``narwhal.request.handoff_release``).

What the reservation holds follows the same table (:data:`ON_ENTRY`): entering ``handed_off``
gives the prefill slot back (the producer answered), entering ``decoding`` counts the decode as
sent (the consumer counts it from here), ending ``done`` or ``failed`` gives back whatever is
still held, and ``detached`` gives nothing back: the background task that now owns the
reservation does. The reservation keeps no flag of the attempt's life beside this table.

Why a table: the attempt's code (``narwhal.request.attempt``) moves through these states as it
goes, and every move is checked against the table, so a new path that skips a step (a release
forgotten on the way, a retry after output) fails loudly in the tests instead of quietly in a
fleet. Observers (tracing) learn the attempt's life from the moves, never from its private
methods. A move costs a dict lookup and an ``assert``: a handful per request, none per chunk.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from narwhal.fleet.placement import Reservation

if TYPE_CHECKING:
    from narwhal.engines.prefill_result import PrefillResult
    from narwhal.request.accesslog import AccessRecord


class AttemptState(enum.StrEnum):
    """The states of one attempt (this module's docstring draws them); a ``StrEnum``, so a
    lookup in ``NEXT`` hashes in C (a plain ``Enum`` member hashes through Python code)."""

    PLACED = "placed"
    PREFILLING = "prefilling"
    HANDED_OFF = "handed_off"
    DECODING = "decoding"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"
    DETACHED = "detached"


S = AttemptState

NEXT: dict[AttemptState, frozenset[AttemptState]] = {
    # DECODING: a local decode (docs/behaviour.md "Placement")
    S.PLACED: frozenset({S.PREFILLING, S.DECODING, S.FAILED}),
    S.PREFILLING: frozenset({S.HANDED_OFF, S.FAILED, S.DETACHED}),
    S.HANDED_OFF: frozenset({S.DECODING, S.FAILED}),  # FAILED: the handoff is invalid or expired
    S.DECODING: frozenset({S.STREAMING, S.DONE, S.FAILED}),  # DONE: a whole (non-streaming) answer
    S.STREAMING: frozenset({S.DONE, S.FAILED}),
    S.DONE: frozenset(),
    S.FAILED: frozenset(),
    S.DETACHED: frozenset(),
}
"""The allowed moves: an attempt may go from a state only to the states listed for it."""

ENDED = frozenset(state for state, after in NEXT.items() if not after)
"""The states an attempt ends in: ``done``, ``failed`` and ``detached``."""


ON_ENTRY: dict[AttemptState, Callable[[Reservation], None] | None] = {
    S.PLACED: None,
    S.PREFILLING: None,
    S.HANDED_OFF: Reservation.release_prefill,  # the producer answered: its slot is free for the next prefill
    S.DECODING: Reservation.decode_sent,  # the decode leg goes out: the consumer counts it from here
    S.STREAMING: None,
    S.DONE: Reservation.release,
    S.FAILED: Reservation.release,
    S.DETACHED: None,  # the background task that owns the reservation gives it back
}
"""What entering a state does to the attempt's reservation (each step idempotent)."""


class AttemptObserver(Protocol):
    """Something that watches attempts move (``narwhal.request.tracing``), told of every move
    after it happened. It may replace ``life.forward``, the headers the next engine leg is
    sent with (a trace context), and keep what it needs in ``life.observed``. It must not raise."""

    def moved(self, life: AttemptLife, before: AttemptState, error: BaseException | None) -> None:
        """``life`` went from ``before`` to ``life.state``; ``error`` is why it failed, if it did."""


@dataclass(slots=True, eq=False)
class AttemptLife:
    """One attempt's state and what an observer may read of it: the reservation, the access
    record, the backend request id and, once the producer answered, the prefill's result."""

    resv: Reservation
    rec: AccessRecord
    request_id: str
    forward: dict[str, str]  # the headers each engine leg carries (the client's trace context and such)
    observer: AttemptObserver | None = None
    state: AttemptState = S.PLACED
    result: PrefillResult | None = None
    observed: Any = field(default=None)  # the observer's own (tracing: the open leg's span)

    def to(self, state: AttemptState, error: BaseException | None = None) -> None:
        """Move to ``state``, which the table must allow from the current one."""
        before = self.state
        assert state in NEXT[before], f"an attempt cannot go from {before.value} to {state.value}"
        self.state = state
        entry = ON_ENTRY[state]  # every state is there: a subscript, not a method call
        if entry is not None:
            entry(self.resv)
        if self.observer is not None:
            self.observer.moved(self, before, error)

    def end(self, error: BaseException | None) -> None:
        """The attempt is over: ``failed`` unless it already ended (done, or detached)."""
        if self.state not in ENDED:
            self.to(S.FAILED, error)
