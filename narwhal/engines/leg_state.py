"""Where a decode leg (``narwhal.engines.decode``) is, and the only ways it may move on.

The states (:class:`LegState`; ``NEXT`` is this table, and a move not in it fails an ``assert``:
a programming error, which ``tests/unit/engines/test_leg_states.py`` provokes)::

    state      moves to                 what it means
    NEW        SENT, CLOSED             built, the body encoded, nothing sent
    SENT       AWAITING, ENDED, CLOSED  the request went out (the consumer has the handoff); a
                                        stream's 200 head -> AWAITING, a whole answer -> ENDED
    AWAITING   STREAMING, CLOSED        metadata is held until the first token
    STREAMING  ENDED, FAILED, CLOSED    the first token went out; only the end and errors matter
    ENDED      CLOSED                   the terminal event (or the whole answer) came cleanly
    FAILED     CLOSED                   an error event after output: the output goes out first,
                                        the error on the next call
    CLOSED     -                        close() ran (a second call does nothing)

A failure leaves the state where it was; close() then closes the connection (only ENDED offers
it to the pool). ``sent`` is ``state is not NEW`` (read it before close()). Why a table, not
flags: four booleans and an error formed a machine nobody had written down; a move is still one
attribute write (module constants: no lookup on the enum class, no call).

Invariant: ``DecodeLeg`` writes its state only right after an ``assert`` that ``NEXT`` allows
the move (a test walks its source for it). Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum


class LegState(enum.IntEnum):
    """Where a decode leg is (the module's table); an IntEnum, so a lookup in NEXT hashes in C."""

    NEW = 0
    SENT = 1
    AWAITING = 2
    STREAMING = 3
    ENDED = 4
    FAILED = 5
    CLOSED = 6


NEW, SENT, AWAITING, STREAMING, ENDED, FAILED, CLOSED = LegState
NEXT: dict[LegState, frozenset[LegState]] = {
    NEW: frozenset({SENT, CLOSED}),
    SENT: frozenset({AWAITING, ENDED, CLOSED}),
    AWAITING: frozenset({STREAMING, CLOSED}),
    STREAMING: frozenset({ENDED, FAILED, CLOSED}),
    ENDED: frozenset({CLOSED}),
    FAILED: frozenset({CLOSED}),
    CLOSED: frozenset(),
}
"""The allowed moves: each state's successors (the table in this module's text)."""
READING = frozenset({AWAITING, STREAMING, ENDED, FAILED})  # where next_span() may be called


def illegal(state: LegState, to: LegState) -> str:
    """The message of a move not in NEXT (built only when the assert fails)."""
    return f"decode leg: {state.name} -> {to.name} is not a move (leg_state.NEXT)"
