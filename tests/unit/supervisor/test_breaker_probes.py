"""Quarantine, the eject cap and the probe schedule (docs/behaviour.md "Recovery"): injected times, no sleeps."""

from __future__ import annotations

import pytest

from narwhal.supervisor.breaker import EngineStatus, ProbePlan, State
from tests.unit.supervisor.breaker_support import (
    breakers,
    decode_fault,
    eject_by_faults,
    mesh,
    ok,
    prefill_fault,
    state,
    streak,
)

# ------------------------------------------------------------- quarantine and the eject cap


def test_quarantine_starts_on_a_charged_failure_and_ends_on_tick() -> None:
    b = breakers(mesh(["p1"], ["d1", "d2"]), failure_quarantine_s=10)
    b.record(decode_fault("p1", "d1", 100.0, before=False))
    assert b.status("d1") == EngineStatus("d1", State.QUARANTINED, 1, 0, 110.0, "first_token_timeout", 100.0)
    assert (b.admitted("d1", 109.9), b.admitted("d1", 110.0)) == (False, True)
    b.record(decode_fault("p1", "d1", 105.0, before=False))
    assert b.status("d1").quarantined_until == 115.0
    b.tick(114.9)
    assert state(b, "d1") is State.QUARANTINED
    b.tick(115.0)
    assert (state(b, "d1"), b.status("d1").quarantined_until) == (State.ADMITTED, None)
    assert b.admitted("d1", 115.0)
    assert state(b, "p1") is State.ADMITTED  # the post-first-token fault is the consumer's alone


def test_a_success_does_not_lift_a_quarantine() -> None:
    b = breakers(mesh(["p1"], ["d1", "d2"]), failure_quarantine_s=10)
    b.record(decode_fault("p1", "d1", 0.0, before=False))
    b.record(ok("p1", "d1", 1.0))
    assert (state(b, "d1"), streak(b, "d1")) == (State.QUARANTINED, 0)


def test_max_ejected_fraction_leaves_the_engine_degraded() -> None:
    b = breakers(mesh(["p1"], ["d1", "d2"]), max_ejected_fraction=0.5)
    for t in (1.0, 2.0, 3.0):
        b.record(decode_fault("p1", "d1", t, before=False))
    assert state(b, "d1") is State.EJECTED  # 1/2 allowed
    for t in (4.0, 5.0, 6.0, 7.0):
        b.record(decode_fault("p1", "d2", t, before=False))
    assert b.status("d2") == EngineStatus("d2", State.DEGRADED, 4, 0, None, "first_token_timeout", 7.0)
    assert b.admitted("d2", 7.0)
    b.readmit("d1", 8.0)
    b.record(decode_fault("p1", "d2", 9.0, before=False))  # re-checked on the next failure
    assert (state(b, "d2"), b.status("d2").ejections) == (State.EJECTED, 1)


def test_degraded_engine_is_admitted_again_on_success() -> None:
    b = breakers(mesh(["p1"], ["d1"]), max_ejected_fraction=0.0)
    for t in (1.0, 2.0, 3.0):
        b.record(decode_fault("p1", "d1", t, before=False))
    assert state(b, "d1") is State.DEGRADED
    b.record(ok("p1", "d1", 4.0))
    assert (state(b, "d1"), streak(b, "d1")) == (State.ADMITTED, 0)


def test_degraded_with_quarantine_returns_to_degraded() -> None:
    b = breakers(mesh(["p1"], ["d1"]), max_ejected_fraction=0.0, failure_quarantine_s=5)
    for t in (1.0, 2.0, 3.0):
        b.record(decode_fault("p1", "d1", t, before=False))
    assert state(b, "d1") is State.QUARANTINED
    b.tick(8.0)
    assert state(b, "d1") is State.DEGRADED


def test_an_engine_of_role_both_is_checked_in_every_role() -> None:
    # producers: p1, b1 (2); consumers: d1, b1 (2). With d1 out, ejecting b1 would put the
    # consumers at 2/2 > 0.5 although the producers would be at 1/2.
    b = breakers(mesh(["p1"], ["d1"], ["b1"]), max_ejected_fraction=0.5)
    eject_by_faults(b, "d1", 1.0)
    for t in (2.0, 3.0, 4.0):
        b.health_failed("b1", t, "health_check")
    assert state(b, "b1") is State.DEGRADED


# ---------------------------------------------------------------------------------- probes


def test_probe_cadence_doubles_with_each_ejection_and_caps() -> None:
    b = breakers(mesh(["p1"], ["d1"]), readmit_interval_s=5, readmit_interval_max_s=12)
    assert [b.probe_interval(n) for n in (1, 2, 3, 10, 10_000)] == [5, 10, 12, 12, 12]
    expected = {1: 5.0, 2: 10.0, 3: 12.0, 4: 12.0}
    for n, interval in expected.items():
        start = 100.0 * n
        eject_by_faults(b, "d1", start)
        assert b.status("d1").ejections == n
        assert b.due_probes(start + interval - 0.01) == []
        assert b.due_probes(start + interval) == [ProbePlan("d1", "health", False, True, None)]
        assert state(b, "d1") is State.PROBING and not b.admitted("d1", start + interval)
        assert b.due_probes(start + interval + 100) == []  # one probe at a time
        b.probe_result("d1", "pass", start + interval + 1)
        assert b.status("d1") == EngineStatus("d1", State.ADMITTED, 0, n, None, "health_check", start)


@pytest.mark.parametrize("result", ["fail", "inconclusive"])
def test_failed_or_inconclusive_probes_keep_the_interval(result: str) -> None:
    b = breakers(mesh(["p1"], ["d1"]), readmit_interval_s=5, readmit_interval_max_s=60)
    eject_by_faults(b, "d1", 0.0)
    assert b.due_probes(5.0) != []
    b.probe_result("d1", "pass", 6.0)
    eject_by_faults(b, "d1", 10.0)  # second ejection: every 10 s
    t = 20.0
    for _ in range(3):
        assert [p.engine for p in b.due_probes(t)] == ["d1"]
        b.probe_result("d1", result, t + 1)
        assert state(b, "d1") is State.EJECTED
        assert b.due_probes(t + 10.99) == []
        t += 11
    with pytest.raises(ValueError):
        b.probe_result("d1", "maybe", t)


def test_probe_plan_names_the_original_producer_after_a_crossed_failure() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"], ["b1"]), has_contract=True)
    b.record(decode_fault("p1", "d1", 1.0))
    b.record(decode_fault("p2", "d1", 2.0))
    b.record(decode_fault("p1", "d1", 3.0))
    b.record(decode_fault("p2", "d1", 4.0))
    assert state(b, "d1") is State.EJECTED
    for t in (5.0, 6.0, 7.0):
        b.record(decode_fault("p1", "d2", t, before=False))  # not ambiguous: no original producer
    for t in (8.0, 9.0, 10.0):
        b.record(prefill_fault("b1", "d2", t))
    plans = b.due_probes(100.0)
    assert plans == [
        ProbePlan("d1", "probe", False, True, "p2"),
        ProbePlan("d2", "probe", False, True, None),
        ProbePlan("b1", "probe", True, True, None),
    ]


@pytest.mark.parametrize(
    ("readmission", "has_contract", "kind"),
    [("auto", False, "health"), ("auto", True, "probe"), ("probe", False, "probe"), ("health", True, "health")],
)
def test_probe_kind(readmission: str, has_contract: bool, kind: str) -> None:
    b = breakers(mesh(["p1"], ["d1"]), has_contract=has_contract, readmission=readmission)
    eject_by_faults(b, "p1", 0.0)
    assert b.due_probes(5.0) == [ProbePlan("p1", kind, True, False, None)]


def test_health_failures_count_and_passing_checks_reset_nothing() -> None:
    b = breakers(mesh(["p1"], ["d1"]))
    b.health_failed("d1", 1.0, "health_check")
    b.health_failed("d1", 2.0, "engine_unreachable")
    assert b.status("d1") == EngineStatus("d1", State.ADMITTED, 2, 0, None, "engine_unreachable", 2.0)
    b.health_failed("d1", 3.0, "health_check")
    assert state(b, "d1") is State.EJECTED
    version = b.version
    b.health_failed("d1", 4.0, "health_check")  # out: only probes decide now
    b.health_failed("nobody", 4.0, "health_check")
    assert (b.version, b.status("d1").last_failure_at) == (version, 3.0)


def test_reports_about_an_ejected_engine_change_nothing() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    eject_by_faults(b, "d1", 0.0)
    before = b.status("d1")
    b.record(ok("p1", "d1", 1.0))
    b.record(decode_fault("p1", "d1", 2.0, before=False))
    assert b.status("d1") == before
    b.record(decode_fault("p1", "d1", 3.0))  # explained by d1's ejection: not pending on p1
    b.record(decode_fault("p1", "d2", 4.0))
    assert streak(b, "p1") == 0
