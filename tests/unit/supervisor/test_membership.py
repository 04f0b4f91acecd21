"""Engines joining and leaving the breakers and the roster at run time (docs/behaviour.md "Engines that come and go"):
pure rules.
"""

from __future__ import annotations

from narwhal.fleet import Fleet
from narwhal.fleet.blame import State
from narwhal.settings import RecoverySettings, Settings
from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.membership import ChangingBreakers
from tests.unit.supervisor.breaker_support import mesh as fleet


def changing(infos: list, has_contract: bool = False) -> ChangingBreakers:  # type: ignore[type-arg]
    return ChangingBreakers(infos, RecoverySettings(readmit_interval_s=5), has_contract=has_contract)


def test_a_joining_engine_is_probing_until_its_first_checks_pass() -> None:
    b = changing(fleet(producers=["p0"], consumers=["d0"]))
    b.reshape(fleet(producers=["p0", "p1"], consumers=["d0"]), {"p1"}, now=10.0)
    assert b.status("p1").state is State.PROBING and b.joining("p1")
    assert not b.admitted("p1", 10.0)
    plans = b.due_probes(10.0)
    assert [(p.engine, p.kind) for p in plans] == [("p1", "lifecycle")]
    assert b.due_probes(10.5) == []  # one probe at a time
    b.probe_result("p1", "fail", 11.0)
    assert b.status("p1").state is State.PROBING  # it never served: not EJECTED
    assert b.due_probes(15.9) == [] and [p.engine for p in b.due_probes(16.0)] == ["p1"]
    b.probe_result("p1", "pass", 16.5)
    assert b.status("p1").state is State.ADMITTED and not b.joining("p1")


def test_with_a_contract_a_joining_engine_gets_the_transfer_probe() -> None:
    b = changing(fleet(producers=["p0"], consumers=["d0"]), has_contract=True)
    b.reshape(fleet(producers=["p0"], consumers=["d0", "d1"]), {"d1"}, now=0.0)
    assert [(p.engine, p.kind, p.as_consumer) for p in b.due_probes(0.0)] == [("d1", "probe", True)]


def test_engines_that_stay_keep_their_state_and_removed_ones_are_gone() -> None:
    b = changing(fleet(producers=["p0", "p1"], consumers=["d0"]))
    b.eject("p0", 1.0)
    version = b.version
    b.reshape(fleet(producers=["p0"], consumers=["d0"]), set(), now=2.0)
    assert b.version > version
    assert b.status("p0").state is State.EJECTED and b.status("p0").ejections == 1
    assert [s.name for s in b.statuses()] == ["p0", "d0"]


def _spec(name: str, role: str = "both") -> EngineSpec:
    return EngineSpec(name=name, url=f"http://{name}:8000", role=role)


def test_a_roster_keeps_each_engine_at_its_index_and_its_object() -> None:
    f = Fleet(Settings(), [(3, _spec("a", "producer")), (7, _spec("b", "consumer"))])
    a, b = f.by_name["a"], f.by_name["b"]
    assert (a.index, b.index, f.span) == (3, 7, 8)
    assert a.permitted_consumers == (b,)
    version = f.version
    added, removed = f.replace([(7, _spec("b", "consumer")), (1, _spec("c", "consumer"))])
    assert [e.name for e in added] == ["c"] and removed == [a]
    assert f.by_name["b"] is b and f.version > version
    assert [e.index for e in f.engines] == [1, 7]
    assert f.by_name["c"].permitted_producers == ()


def test_blame_is_judged_by_compatible_pairs_in_a_mixed_version_window() -> None:
    """p_old (0.32) and p_new (0.33) may both hand off to d_new by configuration, but only p_new
    is compatible with it: d_new has one producer it can fail with, so a pre-token fault of the
    pair is charged to it too (as 1P/1D's is), not left to an ambiguity only a second producer
    (one it can never pair with) could resolve."""
    from narwhal.fleet.blame import Outcome
    from narwhal.shm.shared import SharedFleet
    from narwhal.supervisor.edge import Supervisor

    settings = Settings.model_validate({"engines": [
        {"name": n, "url": f"http://127.0.0.1:{9100 + i}", "role": r, "models": ["m"]}
        for i, (n, r) in enumerate([("p_old", "producer"), ("p_new", "producer"), ("d_new", "consumer")])]})
    region = SharedFleet.create(engines=4, slots=2)
    try:
        region.assign_engines([(e.name, e.url) for e in settings.engines])
        sup = Supervisor(region, settings)
        fault = Outcome("p_new", "d_new", False, "d_new", "decode", "first_token_timeout", True, True, 1.0)
        sup.breakers.record(fault)
        # Versions unknown: d_new might pair with both producers, so only p_new is charged.
        assert {c.engine for c in sup.breakers.take_charged()} == {"p_new"}
        for name, version in (("p_old", "0.32.0"), ("p_new", "0.33.0"), ("d_new", "0.33.0")):
            sup._set_version(sup.fleet.by_name[name], version)
        sup.breakers.record(fault)
        assert {c.engine for c in sup.breakers.take_charged()} == {"p_new", "d_new"}
    finally:
        region.close()
