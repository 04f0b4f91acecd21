"""Breakers' streaks and blame (docs/behaviour.md "Recovery"): who a fault charges, crossed decodes, same-worker and
local pairs; injected times."""

from __future__ import annotations

from narwhal.supervisor.breaker import EngineStatus, Outcome, State
from tests.unit.supervisor.breaker_support import (
    breakers,
    decode_fault,
    mesh,
    ok,
    prefill_fault,
    state,
    streak,
)

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


def test_a_decode_that_cannot_reach_its_consumer_charges_the_consumer_alone() -> None:
    """1P/1D, where nothing else tells them apart: a refused decode is the consumer's, never the
    producer's (its handoff never met a consumer); other pre-token faults charge both, as before."""
    b = breakers(mesh(["p"], ["d"]), eject_after=2)
    b.record(decode_fault("p", "d", reason="engine_unreachable"))
    assert [(c.engine, c.role, c.failed, c.phase) for c in b.take_charged()] == [("d", "consumer", "d", "decode")]
    assert b.status("p").failure_streak == 0 and b.status("d").failure_streak == 1
    b.record(decode_fault("p", "d", reason="engine_disconnect"))
    assert {(c.engine, c.failed) for c in b.take_charged()} == {("p", "d"), ("d", "d")}
    assert b.take_charged() == []


def test_a_degraded_engine_healthy_again_is_probed_and_a_pass_clears_its_streak() -> None:
    b = breakers(mesh(["p"], ["d"]), eject_after=2, max_ejected_fraction=0.5, readmit_interval_s=5)
    for at in (1.0, 2.0):
        b.record(decode_fault("p", "d", at=at, before=False, reason="engine_disconnect"))
    assert b.status("d").state is State.DEGRADED
    plan = b.degraded_probe("d", 3.0)
    assert plan is not None and plan.as_consumer
    assert b.degraded_probe("d", 3.1) is None  # one at a time
    b.probe_result("d", "fail", 3.2)
    assert b.status("d").state is State.DEGRADED
    assert b.degraded_probe("d", 4.0) is None  # paced: readmit_interval_s after the last
    assert b.degraded_probe("d", 8.1) is not None
    b.probe_result("d", "pass", 8.2)
    assert b.status("d").state is State.ADMITTED and b.status("d").failure_streak == 0
    assert b.degraded_probe("p", 9.0) is None  # only a DEGRADED engine


def test_roles_the_fraction_can_never_eject_are_named() -> None:
    from narwhal.supervisor.breaker import never_ejected

    one_each = [("p0", "producer"), ("d0", "consumer")]
    assert [line.split(":")[0] for line in never_ejected(one_each, 0.5)] == [
        "role producer has 1 engine(s) (p0)", "role consumer has 1 engine(s) (d0)"]
    assert never_ejected(one_each, 1.0) == []
    assert [line.split(":")[0] for line in never_ejected([*one_each, ("d1", "consumer"), ("p1", "both")], 0.4)] == [
        "role producer has 2 engine(s) (p0, p1)"]  # 1/3 of the consumers is within 0.4


def test_the_log_says_what_moved_an_engine_never_a_streak_cleared_that_still_counts() -> None:
    from narwhal.settings import RecoverySettings
    from narwhal.supervisor.transitions import why

    settings = RecoverySettings(eject_after=3, failure_quarantine_s=1.0, readmit_interval_s=5)
    b = breakers(mesh(["p"], ["d"]), **settings.model_dump())
    b.record(decode_fault("p", "d", at=1.0, before=False, reason="engine_disconnect"))
    assert b.status("d").state is State.QUARANTINED
    b.tick(2.5)
    assert why(b.status("d"), b, settings) == "quarantine over; 1 failure(s) in a row, last engine_disconnect"
    b.readmit("d", 3.0)
    assert why(b.status("d"), b, settings) == "readmitted by the operator"
    b.drain("d", 3.5, by="discovery")
    assert why(b.status("d"), b, settings) == "drained by discovery"
    b.eject("p", 4.0, probe=True)
    assert len(b.due_probes(9.1)) == 1
    b.probe_result("p", "fail", 9.2)
    assert why(b.status("p"), b, settings) == "readmission probe: fail; next in 5s"
