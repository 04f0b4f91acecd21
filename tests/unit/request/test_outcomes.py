"""What an attempt reports to the fleet state (narwhal.request.outcomes over shm.worker).

Each test drives :class:`Outcomes` with a real worker view on a real shared region, then reads
back exactly what the supervisor will drain from the worker's ring (pair, failed engine, ring
reason code, flags, time) and what the worker did at once: quarantine the engine a failure is
unambiguously charged to (docs/behaviour.md "Recovery"), and nothing for an uncounted or ambiguous one
(docs/behaviour.md "Recovery").
The clock is a fake, so every time and every quarantine bound is exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from narwhal.errors import EngineClientError, EngineError
from narwhal.fleet import Fleet
from narwhal.request.outcomes import Outcomes
from narwhal.settings import Settings
from narwhal.shm.records import (
    FLAG_BEFORE_TOKEN,
    FLAG_COUNTS,
    FLAG_OK,
    FLAG_PREFILL,
    KIND_LOCAL_OUTCOME,
    KIND_OUTCOME,
    NONE16,
    Report,
)
from narwhal.shm.shared import SharedFleet
from narwhal.shm.worker import WorkerFleetState

QUARANTINE_S = 30.0
T0 = 1000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "monotonic", fake)  # the worker view stamps reports and quarantines with it
    return fake


@pytest.fixture
def fleet() -> Fleet:
    return Fleet(Settings(engines=[
        {"name": "p0", "url": "http://127.0.0.1:9000", "role": "producer", "models": ["m"]},
        {"name": "d0", "url": "http://127.0.0.1:9001", "role": "consumer", "models": ["m"]},
        {"name": "b0", "url": "http://127.0.0.1:9002", "role": "both", "models": ["m"]},
    ]))


@pytest.fixture
def state(fleet: Fleet) -> Iterator[WorkerFleetState]:
    shared = SharedFleet.create(engines=4, slots=2, ring=16)
    shared.assign_engines([(e.name, e.url) for e in fleet.engines])
    slot = shared.claim_slot(os.getpid())
    assert slot is not None
    yield WorkerFleetState(shared, slot, fleet)
    shared.close()


def _drained(state: WorkerFleetState) -> list[tuple[int, int, int, int, int, float]]:
    reports: list[Report] = state.shared.drain(state.slot)
    assert all(r.kind == KIND_OUTCOME for r in reports)
    return [(r.producer, r.consumer, r.failed, r.reason, r.flags, r.at) for r in reports]


def _failures(engine: str, phase: str, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "narwhal_engine_failures_total", {"engine": engine, "phase": phase, "reason": reason}
    )
    return 0.0 if value is None else value


def _admitted(state: WorkerFleetState, fleet: Fleet) -> dict[str, bool]:
    return {e.name: state.admitted(e) for e in fleet.engines}


def test_a_success_reports_the_pair_and_quarantines_nothing(
    fleet: Fleet, state: WorkerFleetState, clock: Clock
) -> None:
    p0, d0 = fleet.by_name["p0"], fleet.by_name["d0"]
    Outcomes(fleet, state, QUARANTINE_S).success(p0, d0)
    assert _drained(state) == [(0, 1, NONE16, 0, FLAG_OK, T0)]
    assert _admitted(state, fleet) == {"p0": True, "d0": True, "b0": True}


def test_a_local_decodes_success_travels_under_its_own_kind(
    fleet: Fleet, state: WorkerFleetState, clock: Clock
) -> None:
    # The supervisor must tell it from a same-worker success: it proves nothing about a producer.
    b0 = fleet.by_name["b0"]
    Outcomes(fleet, state, QUARANTINE_S).success(b0, b0, local=True)
    Outcomes(fleet, state, QUARANTINE_S).success(b0, b0)
    reports = state.shared.drain(state.slot)
    assert [(r.producer, r.consumer, r.flags, r.kind) for r in reports] == [
        (2, 2, FLAG_OK, KIND_LOCAL_OUTCOME), (2, 2, FLAG_OK, KIND_OUTCOME)]
    assert KIND_LOCAL_OUTCOME == 4  # kinds never move, like ring codes


def test_a_charged_prefill_failure_is_reported_and_quarantines_the_producer_at_once(
    fleet: Fleet, state: WorkerFleetState, clock: Clock
) -> None:
    p0, d0 = fleet.by_name["p0"], fleet.by_name["d0"]
    before = _failures("p0", "prefill", "engine_5xx")
    error = EngineError("HTTP 500", reason="engine_5xx", engine="p0", phase="prefill")
    Outcomes(fleet, state, QUARANTINE_S).failure(p0, d0, error, before_first_token=True)
    # engine_5xx is ring code 2 (ring codes never move)
    assert _drained(state) == [(0, 1, 0, 2, FLAG_COUNTS | FLAG_BEFORE_TOKEN | FLAG_PREFILL, T0)]
    # Counted where it is charged (the supervisor's breakers: blame decides whom), not here.
    assert _failures("p0", "prefill", "engine_5xx") == before
    # In this worker, before any supervisor hears of it: p0 is quarantined, nobody else.
    assert _admitted(state, fleet) == {"p0": False, "d0": True, "b0": True}
    assert state.quarantine_left(p0) == QUARANTINE_S
    assert state.any_avoided()
    clock.now = T0 + QUARANTINE_S - 0.001
    assert not state.admitted(p0) and state.quarantine_left(p0) == pytest.approx(0.001)
    clock.now = T0 + QUARANTINE_S
    assert state.admitted(p0) and state.quarantine_left(p0) == 0.0
    assert not state.any_avoided()  # the expired entry went when admitted() found it over


def test_an_uncounted_failure_is_reported_uncounted_and_quarantines_nothing(
    fleet: Fleet, state: WorkerFleetState, clock: Clock
) -> None:
    p0, d0 = fleet.by_name["p0"], fleet.by_name["d0"]
    before = _failures("d0", "decode", "engine_client_error")
    error = EngineClientError("HTTP 429", engine="d0", phase="decode", status=429)
    Outcomes(fleet, state, QUARANTINE_S).failure(p0, d0, error, before_first_token=True)
    # engine_client_error is ring code 11; no FLAG_COUNTS, no FLAG_PREFILL (a decode leg)
    assert _drained(state) == [(0, 1, 1, 11, FLAG_BEFORE_TOKEN, T0)]
    assert _failures("d0", "decode", "engine_client_error") == before
    assert _admitted(state, fleet) == {"p0": True, "d0": True, "b0": True}
    assert not state.any_avoided()


# One failure each (docs/behaviour.md "Recovery"): the pair, the failing leg (engine, phase, reason, whether it
# counts), before the first token or not, the quarantine setting; what the ring carries (pair,
# failed engine, ring reason code, flags) and which engine this worker takes out at once.
# Ring codes never move: engine_5xx 2, engine_disconnect 4, engine_stream_error 10.
FAILURES = [
    # an error object below 500 made uncounted by engines.client: reported, nobody charged
    ("stream_error_uncounted", "p0", "d0", ("d0", "decode", "engine_stream_error", False), False, QUARANTINE_S,
     (0, 1, 1, 10, 0), None),
    # ambiguous (the producer's handoff or the consumer): left to the supervisor
    ("crossed_decode_before_token", "p0", "d0", ("d0", "decode", "engine_disconnect", True), True, QUARANTINE_S,
     (0, 1, 1, 4, FLAG_COUNTS | FLAG_BEFORE_TOKEN), None),
    ("crossed_decode_after_token", "p0", "d0", ("d0", "decode", "engine_disconnect", True), False, QUARANTINE_S,
     (0, 1, 1, 4, FLAG_COUNTS), "d0"),
    # P is D: nothing is ambiguous, the one engine is charged
    ("same_engine_before_token", "b0", "b0", ("b0", "decode", "engine_disconnect", True), True, QUARANTINE_S,
     (2, 2, 2, 4, FLAG_COUNTS | FLAG_BEFORE_TOKEN), "b0"),
    ("no_quarantine_setting", "p0", "d0", ("p0", "prefill", "engine_5xx", True), True, 0.0,
     (0, 1, 0, 2, FLAG_COUNTS | FLAG_BEFORE_TOKEN | FLAG_PREFILL), None),
    ("unknown_engine", "p0", "d0", ("gone", "prefill", "engine_5xx", True), True, QUARANTINE_S,
     (0, 1, NONE16, 2, FLAG_COUNTS | FLAG_BEFORE_TOKEN | FLAG_PREFILL), None),
]


@pytest.mark.parametrize(("case", "producer", "consumer", "leg", "before_token", "quarantine_s", "ring", "out"),
                         FAILURES, ids=[row[0] for row in FAILURES])
def test_a_failure_is_reported_and_charged_as_spec_says(
    fleet: Fleet, state: WorkerFleetState, clock: Clock, case: str, producer: str, consumer: str,
    leg: tuple[str, str, str, bool], before_token: bool, quarantine_s: float, ring: tuple[int, ...],
    out: str | None,
) -> None:
    engine, phase, reason, counts = leg
    error = EngineError("failed", reason=reason, engine=engine, phase=phase)  # type: ignore[arg-type]
    error.counts = counts  # as engines.client sets it for an error object below 500
    Outcomes(fleet, state, quarantine_s).failure(fleet.by_name[producer], fleet.by_name[consumer], error,
                                                 before_first_token=before_token)
    assert _drained(state) == [(*ring, T0)]
    assert _admitted(state, fleet) == {e.name: e.name != out for e in fleet.engines}
    if out is not None:
        assert state.quarantine_left(fleet.by_name[out]) == QUARANTINE_S


def test_reports_keep_their_order_and_times(fleet: Fleet, state: WorkerFleetState, clock: Clock) -> None:
    p0, d0 = fleet.by_name["p0"], fleet.by_name["d0"]
    outcomes = Outcomes(fleet, state, QUARANTINE_S)
    outcomes.success(p0, d0)
    clock.now = T0 + 1.5
    outcomes.failure(p0, d0, EngineError("x", reason="decode_silence", engine="d0", phase="decode"),
                     before_first_token=False)
    clock.now = T0 + 2.0
    outcomes.success(p0, d0)
    assert _drained(state) == [
        (0, 1, NONE16, 0, FLAG_OK, T0),
        (0, 1, 1, 8, FLAG_COUNTS, T0 + 1.5),  # decode_silence is ring code 8
        (0, 1, NONE16, 0, FLAG_OK, T0 + 2.0),
    ]
