"""Breakers, blame, quarantine, probes and readmission (SPEC §5, §6): injected times, no sleeps."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import pytest

from narwhal.fleet.breaker import Breakers, EngineInfo, EngineStatus, Outcome, ProbePlan, State
from narwhal.settings import RecoverySettings

# ------------------------------------------------------------------------------------ helpers


def mesh(
    producers: Iterable[str] = (),
    consumers: Iterable[str] = (),
    both: Iterable[str] = (),
    *,
    waves: dict[str, str] | None = None,
    only: dict[str, list[str]] | None = None,
) -> list[EngineInfo]:
    """A fleet where every producer may hand off to every consumer, unless ``only[name]`` narrows it."""
    roles = {**{n: "producer" for n in producers}, **{n: "consumer" for n in consumers}, **{n: "both" for n in both}}
    only = only or {}

    def permitted(p: str, d: str) -> bool:
        if roles[p] == "consumer" or roles[d] == "producer" or (p == d and roles[p] != "both"):
            return False
        return (p not in only or d in only[p]) and (d not in only or p in only[d])

    return [
        EngineInfo(
            name=name,
            role=role,
            wave=(waves or {}).get(name),
            permitted_consumers=frozenset(d for d in roles if permitted(name, d)),
            permitted_producers=frozenset(p for p in roles if permitted(p, name)),
        )
        for name, role in roles.items()
    ]


def breakers(infos: list[EngineInfo], has_contract: bool = False, **recovery: Any) -> Breakers:
    return Breakers(infos, RecoverySettings(**recovery), has_contract=has_contract)


def ok(p: str, d: str, at: float = 0.0) -> Outcome:
    return Outcome(p, d, True, None, None, None, True, False, at)


def prefill_fault(p: str, d: str, at: float = 0.0, reason: str = "engine_5xx") -> Outcome:
    return Outcome(p, d, False, p, "prefill", reason, True, True, at)


def decode_fault(
    p: str, d: str, at: float = 0.0, *, before: bool = True, reason: str = "first_token_timeout"
) -> Outcome:
    return Outcome(p, d, False, d, "decode", reason, True, before, at)


def state(b: Breakers, name: str) -> State:
    return b.status(name).state


def streak(b: Breakers, name: str) -> int:
    return b.status(name).failure_streak


def eject_by_faults(b: Breakers, name: str, at: float) -> None:
    for _ in range(3):
        b.health_failed(name, at, "health_check")
    assert state(b, name) is State.EJECTED


# ------------------------------------------------------------------------ streaks and resets


def test_streak_ejects_at_eject_after() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    b.record(prefill_fault("p1", "d1", 1.0))
    b.record(prefill_fault("p1", "d2", 2.0, reason="prefill_timeout"))
    assert (state(b, "p1"), streak(b, "p1")) == (State.ADMITTED, 2)
    b.record(prefill_fault("p1", "d1", 3.0, reason="engine_unreachable"))
    assert b.status("p1") == EngineStatus("p1", State.EJECTED, 3, 1, None, "engine_unreachable", 3.0)
    assert not b.admitted("p1", 3.0)
    assert [streak(b, n) for n in ("p2", "d1", "d2")] == [0, 0, 0]


def test_uncounted_outcomes_never_count() -> None:
    b = breakers(mesh(["p1"], ["d1"]), eject_after=1)
    b.record(Outcome("p1", "d1", False, "p1", "prefill", "engine_client_error", False, True, 1.0))
    b.record(Outcome("p1", "d1", False, "d1", "decode", "client_disconnect", False, False, 2.0))
    b.record(Outcome("p1", "d1", False, "d1", "decode", "deadline_exceeded", False, True, 3.0))
    b.record(Outcome("p1", "d1", False, "d1", "decode", "handoff_expired", True, True, 4.0))  # never, even if flagged
    b.record(Outcome("p1", "d1", False, None, None, "engine_5xx", True, True, 5.0))  # not an engine fault
    assert [b.status(n) for n in ("p1", "d1")] == [
        EngineStatus("p1", State.ADMITTED, 0, 0, None, None, None),
        EngineStatus("d1", State.ADMITTED, 0, 0, None, None, None),
    ]
    assert b.version == 0


def test_consumer_streak_resets_on_a_completed_stream() -> None:
    b = breakers(mesh(["p1"], ["d1"]))
    b.record(decode_fault("p1", "d1", 1.0, before=False, reason="decode_silence"))
    b.record(decode_fault("p1", "d1", 2.0, before=False, reason="engine_disconnect"))
    assert streak(b, "d1") == 2
    b.record(ok("p1", "d1", 3.0))
    assert streak(b, "d1") == 0
    assert b.status("d1").last_failure_reason == "engine_disconnect"  # history stays


def test_producer_streak_resets_only_when_its_handoff_is_decoded() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    b.record(prefill_fault("p1", "d1", 1.0))
    b.record(prefill_fault("p1", "d2", 2.0, reason="invalid_handoff"))
    b.record(ok("p2", "d1", 3.0))  # someone else's handoff
    b.record(decode_fault("p1", "d1", 4.0, before=False))  # p1's prefill answered, the stream failed: proves nothing
    assert streak(b, "p1") == 2
    b.record(ok("p1", "d2", 5.0))
    assert streak(b, "p1") == 0


def test_prefill_and_handoff_faults_blame_the_producer_late_decode_faults_the_consumer() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    b.record(prefill_fault("p1", "d1", 1.0, reason="engine_5xx"))
    b.record(
        Outcome("p1", "d1", False, "p1", "decode", "invalid_handoff", True, True, 2.0)
    )  # handoff: P whatever phase
    b.record(decode_fault("p2", "d2", 3.0, before=False, reason="engine_stream_error"))
    assert [streak(b, n) for n in ("p1", "p2", "d1", "d2")] == [2, 0, 0, 1]
    assert b.status("d2").last_failure_reason == "engine_stream_error"


# ----------------------------------------------------------------- ambiguous crossed decodes


def test_one_broken_producer_never_ejects_the_consumers() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    b.record(decode_fault("p1", "d1", 1.0))
    assert [streak(b, n) for n in ("p1", "d1")] == [0, 0]  # neither side charged yet
    b.record(decode_fault("p1", "d2", 2.0))
    assert [streak(b, n) for n in ("p1", "d1", "d2")] == [1, 0, 0]
    for i in range(30):  # including late reports after p1's ejection
        b.record(decode_fault("p1", ("d1", "d2")[i % 2], 3.0 + i, reason="done_before_token"))
    assert state(b, "p1") is State.EJECTED
    assert b.status("p1").ejections == 1
    assert [b.status(d) for d in ("d1", "d2")] == [
        EngineStatus(d, State.ADMITTED, 0, 0, None, None, None) for d in ("d1", "d2")
    ]


def test_one_broken_consumer_is_charged_across_producers() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    b.record(decode_fault("p1", "d1", 1.0))
    b.record(decode_fault("p2", "d1", 2.0))
    assert [streak(b, n) for n in ("d1", "p1", "p2")] == [1, 0, 0]
    b.record(decode_fault("p1", "d1", 3.0))  # the set keeps spanning two producers
    b.record(decode_fault("p2", "d1", 4.0))
    assert b.status("d1") == EngineStatus("d1", State.EJECTED, 3, 1, None, "first_token_timeout", 4.0)
    assert [streak(b, n) for n in ("p1", "p2")] == [0, 0]


def test_a_consumer_success_resets_its_pending_set() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    b.record(decode_fault("p1", "d1", 1.0))
    b.record(ok("p2", "d1", 2.0))
    b.record(decode_fault("p2", "d1", 3.0))  # a new streak: only p2 in it
    assert streak(b, "d1") == 0
    b.record(decode_fault("p1", "d1", 4.0))
    assert streak(b, "d1") == 1


def test_a_producer_success_resets_its_pending_set() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    b.record(decode_fault("p1", "d1", 1.0))
    b.record(ok("p1", "d2", 2.0))
    b.record(decode_fault("p1", "d2", 3.0))
    assert streak(b, "p1") == 0
    b.record(decode_fault("p1", "d1", 4.0))
    assert streak(b, "p1") == 1


def test_single_permitted_producer_charges_the_consumer_at_once() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"], only={"d1": ["p1"]}))
    b.record(decode_fault("p1", "d1", 1.0))
    assert [streak(b, n) for n in ("d1", "p1")] == [1, 0]


def test_single_permitted_consumer_charges_the_producer_at_once() -> None:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"], only={"p1": ["d1"]}))
    b.record(decode_fault("p1", "d1", 1.0))
    assert [streak(b, n) for n in ("p1", "d1")] == [1, 0]


def test_a_lone_pair_charges_both() -> None:
    b = breakers(mesh(["p1"], ["d1"]))
    b.record(decode_fault("p1", "d1", 1.0))
    assert [streak(b, n) for n in ("p1", "d1")] == [1, 1]


def test_the_single_producer_shortcut_yields_to_evidence_against_the_producer() -> None:
    # Every consumer lists only p1: a broken p1 must still not eject them all.
    b = breakers(mesh(["p1"], ["d1", "d2"]))
    b.record(decode_fault("p1", "d1", 1.0))
    b.record(decode_fault("p1", "d1", 2.0))
    assert [streak(b, n) for n in ("d1", "p1")] == [2, 0]  # indistinguishable so far
    for i in range(10):
        b.record(decode_fault("p1", ("d2", "d1")[i % 2], 3.0 + i))
    assert state(b, "p1") is State.EJECTED
    assert [streak(b, n) for n in ("d1", "d2")] == [2, 0]
    assert not any(state(b, d) is State.EJECTED for d in ("d1", "d2"))


def test_the_single_consumer_shortcut_yields_to_evidence_against_the_consumer() -> None:
    # Both producers list only d1: a broken d1 must not eject them both.
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"], only={"p1": ["d1"], "p2": ["d1"]}))
    b.record(decode_fault("p1", "d1", 1.0))
    assert [streak(b, n) for n in ("p1", "d1")] == [1, 0]
    for i in range(10):
        b.record(decode_fault(("p2", "p1")[i % 2], "d1", 2.0 + i))
    assert state(b, "d1") is State.EJECTED
    assert [streak(b, n) for n in ("p1", "p2")] == [1, 0]


def test_a_same_worker_pair_is_not_a_crossed_partner() -> None:
    # b1 may decode its own prefills and p1's: p1 is its only possible crossed producer.
    infos = mesh(["p1"], ["d1"], ["b1"], only={"b1": ["b1", "p1"]})
    assert [i.permitted_producers for i in infos if i.name == "b1"] == [frozenset({"b1", "p1"})]
    b = breakers(infos)
    b.record(decode_fault("p1", "b1", 1.0))
    assert [streak(b, n) for n in ("b1", "p1")] == [1, 0]


def test_same_worker_decode_counts_against_the_engine() -> None:
    b = breakers(mesh(["p1"], ["d1"], ["b1"]))
    b.record(decode_fault("b1", "b1", 1.0))
    b.record(decode_fault("b1", "b1", 2.0, before=False))
    assert streak(b, "b1") == 2
    b.record(ok("b1", "b1", 3.0))
    assert streak(b, "b1") == 0


def test_an_engine_of_role_both_keeps_a_streak_per_role() -> None:
    b = breakers(mesh([], [], ["b1", "b2"]))
    b.record(prefill_fault("b1", "b2", 1.0, reason="invalid_handoff"))
    b.record(ok("b2", "b1", 2.0))  # b1 decodes fine: that says nothing about its handoffs
    b.record(prefill_fault("b1", "b2", 3.0, reason="invalid_handoff"))
    b.record(ok("b2", "b1", 4.0))
    assert streak(b, "b1") == 2
    b.record(prefill_fault("b1", "b2", 5.0, reason="invalid_handoff"))
    assert state(b, "b1") is State.EJECTED



def local_ok(d: str, at: float = 0.0) -> Outcome:
    return Outcome(d, d, True, None, None, None, True, False, at, local=True)


def test_local_and_same_worker_successes_leave_a_producers_crossed_handoff_faults_standing() -> None:
    # b1's crossed handoffs fail on both consumers: the fault is b1's, as a producer.
    b = breakers(mesh([], ["d1", "d2"], ["b1"]))
    b.record(decode_fault("b1", "d1", 1.0))
    assert [streak(b, n) for n in ("b1", "d1")] == [0, 1]  # d1 lists one producer: charged alone
    b.record(local_ok("b1", 2.0))  # b1 decodes a short prompt itself
    b.record(ok("b1", "b1", 3.0))  # and a same-worker pair
    b.record(decode_fault("b1", "d2", 4.0))
    assert [streak(b, n) for n in ("b1", "d2")] == [1, 0]  # b1's set spans d1, d2: b1's
    for t in (5.0, 7.0):
        b.record(local_ok("b1", t))
        b.record(ok("b1", "b1", t + 0.5))
        b.record(decode_fault("b1", ("d1", "d2")[int(t) % 2], t + 1))
    assert state(b, "b1") is State.EJECTED
    assert [(state(b, d), streak(b, d)) for d in ("d1", "d2")] == [(State.ADMITTED, 1), (State.ADMITTED, 0)]


def test_a_same_worker_success_forgives_prefill_faults_but_not_handoff_ones() -> None:
    b = breakers(mesh(["p1"], ["d1"], ["b1"]))
    b.record(prefill_fault("b1", "d1", 1.0, reason="invalid_handoff"))
    b.record(prefill_fault("b1", "b1", 2.0))
    assert streak(b, "b1") == 2
    b.record(ok("b1", "b1", 3.0))  # its prefill works; its handoff is unproven
    assert streak(b, "b1") == 1
    b.record(local_ok("b1", 4.0))  # no prefill at all: proves nothing about the producer
    b.record(prefill_fault("b1", "b1", 5.0))
    assert streak(b, "b1") == 2
    b.record(ok("b1", "d1", 6.0))  # a crossed handoff decoded to [DONE]: everything
    assert streak(b, "b1") == 0


def test_a_lone_both_engine_has_its_prefill_faults_forgiven_by_its_own_successes() -> None:
    b = breakers(mesh([], [], ["b1"]))
    for t in (1.0, 3.0, 5.0):
        b.record(prefill_fault("b1", "b1", t))
        b.record(ok("b1", "b1", t + 1))
    assert (state(b, "b1"), streak(b, "b1")) == (State.ADMITTED, 0)


def test_a_local_success_resets_the_consumer_streak() -> None:
    b = breakers(mesh(["p1"], ["d1"]))
    b.record(decode_fault("p1", "d1", 1.0, before=False))
    b.record(decode_fault("d1", "d1", 2.0))  # a local decode's fault: the consumer's
    assert streak(b, "d1") == 2
    b.record(local_ok("d1", 3.0))
    assert streak(b, "d1") == 0


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
