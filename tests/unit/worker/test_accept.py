"""The accept rule of narwhal.worker.accept (the spread itself is tested through gunicorn in
tests/real_gunicorn/placement/test_connection_spread.py)."""

from __future__ import annotations

from narwhal.worker.accept import LEAD, MAX_PAUSE_S, PAUSE_S, pause_after


def test_a_worker_not_ahead_accepts_at_full_speed() -> None:
    assert pause_after(5, None) == 0.0  # no other worker accepting: take everything
    assert pause_after(0, 0) == 0.0
    assert pause_after(LEAD - 1, 0) == 0.0
    assert pause_after(3, 10) == 0.0  # behind


def test_a_worker_ahead_pauses_longer_the_further_ahead_up_to_a_bound() -> None:
    assert pause_after(LEAD, 0) == PAUSE_S * LEAD
    assert pause_after(LEAD + 1, 0) > pause_after(LEAD, 0)
    # A stuck worker with no connections must not stop the others: one accept per bound.
    assert pause_after(10_000, 0) == MAX_PAUSE_S
