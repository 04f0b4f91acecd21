"""Whole-wave restart, operator actions, a supervisor restart's restore, and the status version
(docs/behaviour.md "Recovery"): injected times."""

from __future__ import annotations

import random
from typing import Any

import pytest

from narwhal.supervisor.breaker import Breakers, EngineStatus, Outcome, ProbePlan, State
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

# ---------------------------------------------------------------------- whole-wave restart


def wave_fleet(**recovery: Any) -> Breakers:
    infos = mesh(["p0", "w1"], ["d0", "w2", "w3"], waves={"w1": "rack", "w2": "rack", "w3": "rack"})
    b = breakers(infos, readmit_interval_s=5, **recovery)
    for name in ("w1", "w2", "w3"):
        eject_by_faults(b, name, 0.0)
    assert [p.engine for p in b.due_probes(5.0)] == ["w1", "w2", "w3"]
    return b


def test_a_wave_is_readmitted_only_when_every_engine_passed() -> None:
    b = wave_fleet()
    b.probe_result("w1", "pass", 6.0)
    b.probe_result("w2", "pass", 7.0)
    assert [state(b, n) for n in ("w1", "w2", "w3")] == [State.EJECTED, State.EJECTED, State.PROBING]
    assert (b.waiting_for_wave("w1"), b.waiting_for_wave("w3")) == (True, False)
    assert b.due_probes(50.0) == []  # waiting engines are not probed again
    b.probe_result("w3", "pass", 8.0)
    assert [state(b, n) for n in ("w1", "w2", "w3")] == [State.ADMITTED] * 3
    assert not b.waiting_for_wave("w1")


def test_after_wave_hold_the_passed_engines_come_back_alone() -> None:
    b = wave_fleet(wave_hold_s=120)
    b.probe_result("w1", "pass", 6.0)
    b.probe_result("w2", "fail", 6.0)
    b.probe_result("w3", "pass", 9.0)
    b.tick(125.9)
    assert state(b, "w1") is State.EJECTED
    b.tick(126.0)  # 120 s after the first pass
    assert [state(b, n) for n in ("w1", "w2", "w3")] == [State.ADMITTED, State.EJECTED, State.ADMITTED]
    assert b.due_probes(200.0) == [ProbePlan("w2", "health", False, True, None)]
    b.probe_result("w2", "pass", 201.0)  # its wave is back: no wait
    assert state(b, "w2") is State.ADMITTED


def test_a_wave_not_entirely_ejected_readmits_one_by_one() -> None:
    b = breakers(mesh(["w1"], ["w2"], waves={"w1": "rack", "w2": "rack"}))
    eject_by_faults(b, "w1", 0.0)
    b.due_probes(5.0)
    b.probe_result("w1", "pass", 6.0)
    assert state(b, "w1") is State.ADMITTED


def test_whole_wave_restart_off_readmits_one_by_one() -> None:
    b = wave_fleet(whole_wave_restart=False)
    b.probe_result("w2", "pass", 6.0)
    assert state(b, "w2") is State.ADMITTED


def test_wave_hold_zero_releases_at_once() -> None:
    b = wave_fleet(wave_hold_s=0)
    b.probe_result("w2", "pass", 6.0)
    assert state(b, "w2") is State.ADMITTED


def test_the_operator_bypasses_the_wave() -> None:
    b = wave_fleet()
    b.probe_result("w1", "pass", 6.0)
    b.readmit("w1", 7.0)  # waiting engine: back at once
    assert state(b, "w1") is State.ADMITTED
    b.probe_result("w2", "pass", 8.0)  # a wave member is back: w2 waits for nobody
    assert state(b, "w2") is State.ADMITTED
    b2 = wave_fleet()
    b2.probe_result("w1", "pass", 6.0)
    b2.probe_result("w2", "pass", 6.0)
    b2.drain("w3", 7.0)  # the last member taken out by the operator releases the others
    assert [state(b2, n) for n in ("w1", "w2", "w3")] == [State.ADMITTED, State.ADMITTED, State.DRAINING]


# ----------------------------------------------------------------------- operator actions


def test_operator_eject_bypasses_the_cap_and_is_not_probed() -> None:
    b = breakers(mesh(["p1"], ["d1"]), max_ejected_fraction=0.0)
    b.eject("d1", 1.0)
    assert b.status("d1") == EngineStatus("d1", State.EJECTED, 0, 1, None, None, None)
    assert b.due_probes(1e9) == []
    assert b.ejected_by_operator("d1")
    b.readmit("d1", 2.0)
    assert (state(b, "d1"), b.admitted("d1", 2.0)) == (State.ADMITTED, True)


def test_operator_eject_of_a_probing_engine_cancels_the_probe() -> None:
    b = breakers(mesh(["p1"], ["d1"]))
    eject_by_faults(b, "d1", 0.0)
    b.due_probes(5.0)
    b.eject("d1", 5.5)
    b.probe_result("d1", "pass", 6.0)  # stale: ignored
    assert (state(b, "d1"), b.status("d1").ejections) == (State.EJECTED, 1)
    assert b.due_probes(1e9) == []


def test_eject_with_probe_is_probed_back() -> None:
    b = breakers(mesh(["p1"], ["d1"]), readmit_interval_s=5)
    b.eject("d1", 0.0, probe=True)  # failed preflight at start
    assert b.due_probes(5.0) == [ProbePlan("d1", "health", False, True, None)]


def test_readmit_clears_streak_and_quarantine() -> None:
    b = breakers(mesh(["p1"], ["d1"]), failure_quarantine_s=30)
    b.record(decode_fault("p1", "d1", 1.0, before=False))
    b.readmit("d1", 2.0)
    assert b.status("d1") == EngineStatus("d1", State.ADMITTED, 0, 0, None, "first_token_timeout", 1.0)


def test_drain() -> None:
    b = breakers(mesh(["p1"], ["d1"]), failure_quarantine_s=30)
    b.drain("d1", 1.0)
    assert (state(b, "d1"), b.admitted("d1", 1.0)) == (State.DRAINING, False)
    for t in (2.0, 3.0, 4.0, 5.0):  # in-flight streams failing: counted, never ejected
        b.record(decode_fault("p1", "d1", t, before=False))
    assert b.status("d1") == EngineStatus("d1", State.DRAINING, 4, 0, None, "first_token_timeout", 5.0)
    b.readmit("d1", 6.0)
    assert (state(b, "d1"), streak(b, "d1")) == (State.ADMITTED, 0)


def test_unknown_engines() -> None:
    b = breakers(mesh(["p1"], ["d1"]))
    b.record(prefill_fault("gone", "d1", 1.0))
    b.record(decode_fault("p1", "gone", 1.0))
    b.record(ok("gone", "d1", 1.0))
    b.probe_result("gone", "pass", 1.0)
    assert b.version == 0
    for call in (lambda: b.status("gone"), lambda: b.eject("gone", 1.0), lambda: b.admitted("gone", 1.0)):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(ValueError):
        breakers([*mesh(["p1"], ["d1"]), *mesh(["p1"])])


# ------------------------------------------------------------------ supervisor restart


def test_restore_takes_over_published_statuses() -> None:
    infos = mesh(["p1", "p2"], ["d1", "d2", "d3"], ["b1"], waves={"d3": "w", "b1": "w"})
    old = breakers(infos, failure_quarantine_s=10, readmit_interval_s=5)
    old.record(prefill_fault("p1", "d1", 1.0))  # quarantined, streak 1
    eject_by_faults(old, "d1", 2.0)
    old.due_probes(7.0)  # d1 PROBING
    old.eject("d2", 3.0)  # operator
    old.drain("p2", 4.0)
    for name in ("d3", "b1"):
        eject_by_faults(old, name, 5.0)
    old.due_probes(10.0)
    old.probe_result("d3", "pass", 11.0)  # waits for b1
    new = breakers(infos, failure_quarantine_s=10, readmit_interval_s=5)
    for st in old.statuses():
        new.restore(st, 20.0, by_operator=old.ejected_by_operator(st.name), waiting=old.waiting_for_wave(st.name))
    new.restore(EngineStatus("gone", State.EJECTED, 9, 9, None, None, None), 20.0)
    probing = {"d1", "b1"}
    expected = [
        EngineStatus(
            s.name, State.EJECTED, s.failure_streak, s.ejections, None, s.last_failure_reason, s.last_failure_at
        )
        if s.name in probing
        else s
        for s in old.statuses()
    ]
    assert new.statuses() == expected
    assert (new.ejected_by_operator("d2"), new.waiting_for_wave("d3")) == (True, True)
    assert [p.engine for p in new.due_probes(20.0)] == ["d1", "b1"]  # interrupted probes run at once
    new.probe_result("b1", "pass", 21.0)
    assert [state(new, n) for n in ("d3", "b1")] == [State.ADMITTED, State.ADMITTED]
    new.tick(30.0)
    assert (state(new, "p1"), new.admitted("p1", 30.0)) == (State.ADMITTED, True)
    new.probe_result("d1", "fail", 22.0)
    assert new.due_probes(26.99) == [] and new.due_probes(27.0) == [ProbePlan("d1", "health", False, True, None)]


def test_restore_normalises_a_record_against_the_settings() -> None:
    b = breakers(mesh(["p1"], ["d1"]), eject_after=3)
    b.restore(EngineStatus("d1", State.ADMITTED, 5, 0, None, "engine_5xx", 1.0), 2.0)  # eject_after was raised
    assert state(b, "d1") is State.DEGRADED
    b.restore(EngineStatus("p1", State.EJECTED, 3, 2, None, "engine_5xx", 1.0), 2.0)
    assert b.due_probes(11.99) == [] and [p.engine for p in b.due_probes(12.0)] == ["p1"]  # 2nd ejection: 10 s


# --------------------------------------------------------------------------------- version


def test_version_moves_exactly_when_a_status_changes() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]), failure_quarantine_s=10)
    steps: list[tuple[str, Any]] = [
        ("no change: success of a clean pair", lambda: b.record(ok("p1", "d1", 1.0))),
        ("streak", lambda: b.record(decode_fault("p1", "d1", 2.0, before=False))),
        ("no change: tick before the deadline", lambda: b.tick(5.0)),
        ("quarantine ends", lambda: b.tick(12.0)),
        ("no change: tick again", lambda: b.tick(13.0)),
        ("streak reset", lambda: b.record(ok("p1", "d1", 14.0))),
        ("no change: ambiguous fault pending", lambda: b.record(decode_fault("p1", "d2", 15.0))),
        ("drain", lambda: b.drain("d2", 16.0)),
        ("no change: drain again", lambda: b.drain("d2", 17.0)),
        ("no change: no probe due", lambda: b.due_probes(18.0)),
    ]
    for what, step in steps:
        before, version = b.statuses(), b.version
        step()
        changed = b.statuses() != before
        assert changed == (not what.startswith("no change")), what
        assert b.version == version + changed, what


def test_random_walk_keeps_the_invariants_and_the_version_honest() -> None:
    """Invariants are asserted inside Breakers on every touched engine; here the version."""
    rng = random.Random(7)
    infos = mesh(["p1", "p2"], ["d1", "d2"], ["b1", "b2"], waves={"b1": "w", "b2": "w", "d2": "w"})
    b = breakers(infos, failure_quarantine_s=3, max_ejected_fraction=0.5, wave_hold_s=20, readmit_interval_s=2)
    names = [i.name for i in infos]
    pairs = [(i.name, d) for i in infos for d in sorted(i.permitted_consumers)]
    reasons = ["engine_5xx", "first_token_timeout", "engine_client_error", "decode_silence"]
    seen: set[State] = set()
    probing: list[str] = []

    def step(call: Any, *args: Any) -> Any:
        before, version = b.statuses(), b.version
        result = call(*args)
        assert b.version == version + (b.statuses() != before)
        return result

    t = 0.0
    for _ in range(3000):
        t += rng.random()
        p, d = rng.choice(pairs)
        roll = rng.random()
        if roll < 0.3:
            step(b.record, ok(p, d, t))
        elif roll < 0.45:
            step(b.record, prefill_fault(p, d, t, reason=rng.choice(reasons)))
        elif roll < 0.75:
            reason = rng.choice(reasons)
            counts = reason != "engine_client_error"
            step(b.record, Outcome(p, d, False, d, "decode", reason, counts, rng.random() < 0.6, t))
        elif roll < 0.8:
            step(b.health_failed, rng.choice(names), t, "health_check")
        elif roll < 0.88:
            step(b.tick, t)
        elif roll < 0.95:
            probing += [plan.engine for plan in step(b.due_probes, t)]
            rng.shuffle(probing)
            while probing and rng.random() < 0.7:  # some results come later (or are stale by then)
                step(b.probe_result, probing.pop(), rng.choice(["pass", "fail", "inconclusive"]), t)
        else:
            step(rng.choice([b.eject, b.readmit, b.drain]), rng.choice(names), t)
        for s in b.statuses():
            serving = s.state in (State.ADMITTED, State.DEGRADED)
            expired = s.state is State.QUARANTINED and s.quarantined_until is not None and s.quarantined_until <= t
            assert b.admitted(s.name, t) == (serving or expired)
        seen.update(s.state for s in b.statuses())
    assert seen == set(State)  # the walk visited every state
