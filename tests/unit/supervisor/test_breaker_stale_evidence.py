"""Evidence gathered before an engine came back charges nothing (the chaos run's end-state flake).

A health check sent while an engine was failing, answered after a probe readmitted it, used to
eject the engine again with every fault cleared and no traffic.
"""

from __future__ import annotations

from narwhal.supervisor.breaker import Breakers, State
from tests.unit.supervisor.breaker_support import breakers, eject_by_faults, mesh, state, streak


def readmitted_by_probe(name: str, at: float) -> Breakers:
    b = breakers(mesh(["p1", "p2"], ["d1", "d2"]))
    eject_by_faults(b, name, 0.0)
    (plan,) = b.due_probes(at)
    b.probe_result(plan.engine, "pass", at)
    assert state(b, name) is State.ADMITTED
    return b


def test_a_health_check_sent_before_the_readmission_charges_nothing() -> None:
    b = readmitted_by_probe("d1", 10.0)
    version = b.version
    b.health_failed("d1", 11.0, "health_check", sent_at=9.5)
    assert (state(b, "d1"), streak(b, "d1"), b.version) == (State.ADMITTED, 0, version)


def test_a_health_check_sent_after_the_readmission_counts() -> None:
    b = readmitted_by_probe("d1", 10.0)
    b.health_failed("d1", 11.0, "health_check", sent_at=10.5)
    assert (state(b, "d1"), streak(b, "d1")) == (State.ADMITTED, 1)
