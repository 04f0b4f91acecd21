"""The supervisor's loop a pass at a time (``Loop.step``) on a real shared region, its time a
fake clock: a worker's failure reports eject an engine fleet-wide within one pass, the probe is
started only when the readmission interval has passed on that clock, a passing probe readmits,
and health checks start once per ``health_interval_s``. No sleep decides anything: the fake
prober answers at once and the test advances the clock."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from narwhal.engines.control import PooledReader
from narwhal.errors import EngineError
from narwhal.fleet import Engine, Fleet
from narwhal.settings import Settings
from narwhal.shm.records import read_record
from narwhal.shm.shared import SharedFleet
from narwhal.shm.worker import WorkerFleetState
from narwhal.supervisor.breaker import State
from narwhal.supervisor.edge import Supervisor
from narwhal.supervisor.load import LoadReader
from narwhal.supervisor.loop import Loop

READMIT_S = 5.0
HEALTH_S = 30.0


class FakeClock:
    """Monotonic seconds that move only when the test says so. It starts at the real clock's
    reading: a worker's report carries its own monotonic time, and an ejection dates from it."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


class FakeProber:
    """Answers probes and health checks at once with a set verdict, and counts them."""

    def __init__(self) -> None:
        self.probes: list[tuple[str, str]] = []
        self.health: list[str] = []
        self.verdict = "pass"

    async def probe(self, engine: Engine, kind: str, as_producer: bool, as_consumer: bool,
                    producer: str | None) -> tuple[str, str]:
        self.probes.append((engine.name, kind))
        return self.verdict, ""

    async def health_failure(self, engine: Engine) -> str | None:
        self.health.append(engine.name)
        return None


@pytest.fixture
def settings() -> Settings:
    return Settings.model_validate({
        "recovery": {"eject_after": 2, "readmit_interval_s": READMIT_S, "health_interval_s": HEALTH_S,
                     "readmission": "health"},
        "placement": {"load_interval_s": 0},  # no /metrics reads: nothing here answers them
        "engines": [{"name": "p0", "url": "http://127.0.0.1:1", "role": "producer"},
                    {"name": "d0", "url": "http://127.0.0.1:2", "role": "consumer"},
                    {"name": "d1", "url": "http://127.0.0.1:3", "role": "consumer"}],
    })


def started(shared: SharedFleet, settings: Settings) -> tuple[Supervisor, Loop, FakeClock, FakeProber]:
    clock, prober = FakeClock(), FakeProber()
    supervisor = Supervisor(shared, settings, clock=clock)
    loads = LoadReader(shared, PooledReader(settings.engine, 1.0))
    return supervisor, Loop.start(supervisor, prober, loads), clock, prober  # type: ignore[arg-type]


def state_in_shared_memory(shared: SharedFleet, slot: int) -> State:
    record = read_record(shared.region, slot)
    assert record is not None
    return State(record.state)


async def settle(supervisor: Supervisor) -> None:
    """Let the tasks a pass started (probes, health checks) run to their end: they never wait."""
    for _ in range(10):
        tasks = supervisor.checks.under_way
        if not tasks:
            return
        await asyncio.gather(*tasks)


def decode_failure() -> EngineError:
    return EngineError("decode failed", reason="engine_5xx", engine="d0", phase="decode")


def charge_d0(supervisor: Supervisor, worker: WorkerFleetState, clock: FakeClock) -> Engine:
    """d0 charged ``eject_after`` (2) times through ``worker``'s ring, the clock set to the
    reports' time (the ejection dates from it); d0 is returned."""
    p0, d0 = (next(e for e in supervisor.fleet.engines if e.name == n) for n in ("p0", "d0"))
    for _ in range(2):  # the decode phase: the consumer is charged
        worker.report(p0, d0, error=decode_failure(), failed=d0, before_first_token=True)
    clock.now = time.monotonic()
    return d0


async def test_reports_eject_within_a_pass_and_a_probe_readmits_after_the_interval(
    shared: SharedFleet, settings: Settings
) -> None:
    supervisor, loop, clock, prober = started(shared, settings)
    worker = WorkerFleetState(shared, shared.claim_slot(os.getpid()) or 0, Fleet(settings))
    slot = shared.engine_slot("d0", "http://127.0.0.1:2")
    assert slot is not None and state_in_shared_memory(shared, slot) is State.ADMITTED
    generation = shared.generation
    d0 = charge_d0(supervisor, worker, clock)
    loop.step()
    assert state_in_shared_memory(shared, slot) is State.EJECTED
    assert shared.generation > generation  # workers re-read the records on their next request
    assert not worker.admitted(d0)

    clock.now += READMIT_S - 0.5
    loop.step()
    await settle(supervisor)
    assert prober.probes == []  # not yet due on the supervisor's clock
    clock.now += 1.0
    loop.step()
    await settle(supervisor)
    assert prober.probes == [("d0", "health")]
    loop.step()  # the probe's verdict is published by the next pass
    assert state_in_shared_memory(shared, slot) is State.ADMITTED
    assert worker.admitted(d0)


async def test_a_failed_probe_keeps_the_engine_out_and_the_next_comes_one_interval_later(
    shared: SharedFleet, settings: Settings
) -> None:
    supervisor, loop, clock, prober = started(shared, settings)
    worker = WorkerFleetState(shared, shared.claim_slot(os.getpid()) or 0, Fleet(settings))
    d0 = charge_d0(supervisor, worker, clock)
    loop.step()
    prober.verdict = "fail"
    clock.now += READMIT_S + 0.5
    loop.step()
    await settle(supervisor)
    loop.step()
    assert prober.probes == [("d0", "health")] and not worker.admitted(d0)
    clock.now += READMIT_S - 0.5  # a failed probe keeps the interval (it doubles per ejection)
    loop.step()
    await settle(supervisor)
    assert len(prober.probes) == 1
    clock.now += 1.0
    loop.step()
    await settle(supervisor)
    assert prober.probes == [("d0", "health")] * 2 and not worker.admitted(d0)


async def test_health_checks_start_once_per_interval_for_admitted_engines(
    shared: SharedFleet, settings: Settings
) -> None:
    supervisor, loop, clock, prober = started(shared, settings)
    loop.step()
    await settle(supervisor)
    assert prober.health == []  # the first round is one interval after the start
    clock.now += HEALTH_S
    loop.step()
    await settle(supervisor)
    assert sorted(prober.health) == ["d0", "d1", "p0"]
    clock.now += HEALTH_S / 2
    loop.step()
    await settle(supervisor)
    assert len(prober.health) == 3


def test_every_pass_beats_with_the_supervisors_pid(shared: SharedFleet, settings: Settings) -> None:
    supervisor, loop, _, _ = started(shared, settings)
    loop.step()
    assert shared.supervisor_pid == os.getpid() and shared.heartbeat_age_s < 5



async def test_a_refused_connection_is_published_unreachable_logged_and_cleared_by_an_answer(
    shared: SharedFleet, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    supervisor, loop, clock, prober = started(shared, settings)
    worker = WorkerFleetState(shared, shared.claim_slot(os.getpid()) or 0, Fleet(settings))
    p0, d1 = (next(e for e in supervisor.fleet.engines if e.name == n) for n in ("p0", "d1"))
    refused = EngineError("engine d1 is unreachable (decode)", reason="engine_unreachable", engine="d1", phase="decode")
    refused.connect_failed = True
    caplog.set_level("INFO", logger="narwhal.supervisor.breakers")
    worker.report(p0, d1, error=refused, failed=d1, before_first_token=True)
    loop.step()
    assert worker.unreachable(d1) and not worker.admitted(d1)
    assert worker.placeable(d1)  # still placeable: last resort, never removed
    assert "engine d1: unreachable (its last connection attempt failed)" in caplog.text
    supervisor.connected(d1, answered=True, refused=False)  # a /metrics or /health answer
    loop.step()
    assert not worker.unreachable(d1) and worker.admitted(d1)
    assert "engine d1: reachable again" in caplog.text


async def test_every_breaker_transition_is_one_log_line_with_its_engine_state_and_why(
    shared: SharedFleet, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    supervisor, loop, clock, prober = started(shared, settings)
    worker = WorkerFleetState(shared, shared.claim_slot(os.getpid()) or 0, Fleet(settings))
    caplog.set_level("INFO", logger="narwhal.supervisor.breakers")
    charge_d0(supervisor, worker, clock)
    loop.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "narwhal.supervisor.breakers"]
    assert lines == ["engine d0 (consumer): admitted -> ejected: 2 failure(s) in a row, last engine_5xx; ejection 1"]
    clock.now += READMIT_S + 0.5
    loop.step()
    await settle(supervisor)
    loop.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "narwhal.supervisor.breakers"]
    assert lines[1:] == ["engine d0 (consumer): ejected -> probing: readmission probe under way",
                         "engine d0 (consumer): probing -> admitted: readmission probe passed"]
