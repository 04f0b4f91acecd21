"""The attempt's state table (narwhal.request.attempt_state) and the handoff-release table
(narwhal.request.handoff_release): their rules, checked as tables."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.fleet.placement import LocalInflight, Reservation
from narwhal.request.attempt_state import ENDED, NEXT, AttemptLife, AttemptState
from narwhal.request.handoff_release import RULES, Ending
from tests.unit.fleet.placement_support import fleet_of, place

S = AttemptState


def _life(observer: Any = None, resv: Reservation | None = None) -> AttemptLife:
    if resv is None:
        resv = place(fleet_of(producers=1, consumers=1)[0])
    return AttemptLife(resv=resv, rec=None, request_id="r", forward={}, observer=observer)  # type: ignore[arg-type]


def _held(inflight: LocalInflight) -> tuple[list[int], list[int], list[int]]:
    """(prefill slots, decode slots, unsent decodes) per engine: p0, d0."""
    return inflight.totals("prefill"), inflight.totals("decode"), list(inflight.unsent)


@pytest.mark.parametrize(("path", "held"), [
    ([], ([1, 0], [0, 1], [0, 1])),  # placed: both slots, the decode not sent yet
    ([S.PREFILLING], ([1, 0], [0, 1], [0, 1])),
    ([S.PREFILLING, S.HANDED_OFF], ([0, 0], [0, 1], [0, 1])),  # the producer answered: its slot is back
    ([S.PREFILLING, S.HANDED_OFF, S.DECODING], ([0, 0], [0, 1], [0, 0])),  # sent: the consumer counts it
    ([S.PREFILLING, S.HANDED_OFF, S.DECODING, S.STREAMING, S.DONE], ([0, 0], [0, 0], [0, 0])),
    ([S.PREFILLING, S.FAILED], ([0, 0], [0, 0], [0, 0])),
    ([S.PREFILLING, S.DETACHED], ([1, 0], [0, 1], [0, 1])),  # the background task's to give back
])
def test_the_reservation_follows_the_attempts_table(path: list[AttemptState], held: tuple[Any, ...]) -> None:
    placement, _, _, inflight, _ = fleet_of(producers=1, consumers=1)
    life = _life(resv=place(placement))
    for state in path:
        life.to(state)
    assert _held(inflight) == held
    life.end(RuntimeError("late"))  # an attempt that ended gives nothing back twice
    if life.state is not S.DETACHED:
        assert _held(inflight) == ([0, 0], [0, 0], [0, 0])


def test_every_state_is_reachable_and_every_life_ends() -> None:
    reached, frontier = {S.PLACED}, [S.PLACED]
    while frontier:
        for after in NEXT[frontier.pop()]:
            if after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(S)
    assert ENDED == {S.DONE, S.FAILED, S.DETACHED}
    # Every state that has not ended may fail; only a prefill may be detached from.
    assert all(S.FAILED in NEXT[state] for state in set(S) - ENDED)
    assert [state for state in S if S.DETACHED in NEXT[state]] == [S.PREFILLING]
    # Output reaches the client only after a decode started; nothing goes back.
    assert [state for state in S if S.STREAMING in NEXT[state]] == [S.DECODING]


@pytest.mark.parametrize(("path", "bad"), [
    ([], S.STREAMING),  # output before any decode
    ([S.PREFILLING], S.DECODING),  # a decode with an unchecked handoff
    ([S.PREFILLING, S.HANDED_OFF, S.DECODING, S.STREAMING], S.PREFILLING),  # a retry after output
    ([S.DECODING, S.DONE], S.FAILED),  # an ended attempt moves no more
])
def test_a_move_the_table_does_not_allow_fails_loudly(path: list[AttemptState], bad: AttemptState) -> None:
    life = _life()
    for state in path:
        life.to(state)
    with pytest.raises(AssertionError, match=f"cannot go from {life.state.value} to {bad.value}"):
        life.to(bad)


def test_the_observer_hears_each_move_and_end_fails_only_a_live_attempt() -> None:
    heard: list[tuple[str, str, Any]] = []

    class Ear:
        def moved(self, life: AttemptLife, before: AttemptState, error: BaseException | None) -> None:
            heard.append((before.value, life.state.value, error))

    boom = RuntimeError("x")
    life = _life(Ear())
    life.to(S.PREFILLING)
    life.end(boom)
    life.end(boom)  # already ended: nothing more
    assert heard == [("placed", "prefilling", None), ("prefilling", "failed", boom)]
    detached = _life(Ear())
    detached.to(S.PREFILLING)
    detached.to(S.DETACHED)
    detached.end(boom)
    assert detached.state is S.DETACHED and len(heard) == 4


def test_every_ending_has_a_rule_and_only_a_rejected_handoff_is_kept_from_consumers() -> None:
    assert set(RULES) == set(Ending)
    assert [e for e, rule in RULES.items() if not rule.release] == [Ending.REJECTED]
    # Only a consumer that just failed to connect is asked last.
    assert [e for e, rule in RULES.items() if not rule.chosen_first] == [Ending.NOT_SENT_CONSUMER_FAULT]
