"""Model discovery in the supervisor (``supervisor.models``), its loop's pass driven on a fake
clock against a real shared region, and a worker's view of the result (``worker.models_follow``):
every engine read at the start, a readmitted one again, one that never answered every retry, the
bounds logged once, a restarted supervisor starting from what was published. The fake control
client answers at once; the test runs the reads' tasks to their end, nothing sleeps."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import orjson
import pytest

from narwhal.engines.control import ControlError, EngineRef, PooledReader
from narwhal.fleet import Engine, Fleet
from narwhal.master.gunicorn_hooks import create_policy_region
from narwhal.settings import Settings
from narwhal.shm import models as M
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.supervisor.edge import Supervisor
from narwhal.supervisor.holdings.part import HoldingsPart
from narwhal.supervisor.load import LoadReader
from narwhal.supervisor.loop import Loop
from narwhal.supervisor.models import REFRESH_S, RETRY_S, ModelReader
from narwhal.worker.models_follow import ModelsFollower

ENGINES = [{"name": "p0", "url": "http://127.0.0.1:1", "role": "producer"},
           {"name": "d0", "url": "http://127.0.0.1:2", "role": "consumer"},
           {"name": "c0", "url": "http://127.0.0.1:3", "role": "consumer", "models": ["fixed"]}]


VERSION = "0.33.0"


class FakeControl:
    """``/v1/models`` answered at once from ``answers`` (None: unreachable); every read counted.
    ``/version`` (read with them, docs/decisions.md "vLLM releases") answers ``VERSION``, for engines[].models ones
    too."""

    def __init__(self, **answers: list[str] | None) -> None:
        self.answers = answers
        self.reads: list[str] = []
        self.version_reads: list[str] = []
        self.refusing: set[str] = set()  # answer 403 on /inference/v1/generate
        self.generate_asks: list[str] = []

    async def generate_refused(self, engine: EngineRef) -> bool | None:
        self.generate_asks.append(engine.name)
        if engine.name in self.answers and self.answers[engine.name] is None:
            return None
        return engine.name in self.refusing

    async def get(self, engine: EngineRef, path: str) -> tuple[int, bytes]:
        if path == "/version":
            self.version_reads.append(engine.name)
            if engine.name in self.answers and self.answers[engine.name] is None:
                raise ControlError("unreachable")
            return 200, orjson.dumps({"version": VERSION})
        assert path == "/v1/models"
        self.reads.append(engine.name)
        models = self.answers.get(engine.name)
        if models is None:
            raise ControlError("unreachable")
        return 200, orjson.dumps({"object": "list", "data": [{"id": m, "object": "model"} for m in models]})


class FakeProber:
    """The loop's prober, never asked here (no probe is due, health checks are far off)."""

    async def probe(self, *args: object) -> tuple[str, str]:
        raise AssertionError("no probe in these tests")

    async def health_failure(self, engine: Engine) -> str | None:
        return None


@pytest.fixture
def settings() -> Settings:
    return Settings.model_validate({
        "recovery": {"health_interval_s": 1.0, "readmission": "health"},
        "placement": {"load_interval_s": 0},
        "engines": ENGINES,
    })


def reading(shared: SharedFleet, settings: Settings, control: FakeControl) -> tuple[Supervisor, ModelReader]:
    """A supervisor taking up a reader through ``control``, as its run would."""
    sup = Supervisor(shared, settings)
    return sup, sup.read_models(ModelReader(control, sup.rounds, settings.recovery.health_interval_s))


async def settle(sup: Supervisor, now: float | None = None) -> None:
    """Start the reads a tick queued (the loop's passes would, ``supervisor.rounds``) and run them
    to their end (the fake answers at once), then the pass that settles and publishes their
    answers (``now``: the clock of that pass; no read is due at it)."""
    assert sup.models is not None
    while sup.rounds.under_way or sup.models._tasks:
        sup.rounds.run()
        await asyncio.gather(*sup.models._tasks)
    if now is not None:
        sup.tick_models(now)


def models_of(fleet: Fleet) -> dict[str, set[str]]:
    return {e.name: set(e.models) for e in fleet.engines}


def follower(shared: SharedFleet, settings: Settings) -> ModelsFollower:
    return ModelsFollower(shared, Fleet(settings), by_slot=False)


async def test_the_start_reads_each_engine_once_and_workers_take_the_models_up(
    shared: SharedFleet, settings: Settings
) -> None:
    control = FakeControl(p0=["m-one"], d0=["m-one", "lora-a"])
    sup, _ = reading(shared, settings, control)
    worker = follower(shared, settings)
    assert worker.unread() == ["p0", "d0"]  # nothing published yet: a starting worker waits
    now = time.monotonic()
    sup.tick_models(now)
    assert worker.unread() == ["p0", "d0"]  # published PENDING, reads under way
    await settle(sup, now)
    assert sorted(control.reads) == ["d0", "p0"]  # engines[].models set: never read
    assert worker.unread() == []
    worker.check()
    assert models_of(worker.fleet) == {"p0": {"m-one"}, "d0": {"m-one", "lora-a"}, "c0": {"fixed"}}
    assert worker.fleet.served_models == {"m-one", "lora-a", "fixed"}
    assert models_of(sup.fleet) == models_of(worker.fleet)  # the supervisor's probes pick from them too
    # Every engine's /version, an engines[].models one's too: published with the models.
    assert sorted(control.version_reads) == ["c0", "d0", "p0"]
    assert {e.name: e.version for e in worker.fleet.engines} == {"p0": VERSION, "d0": VERSION, "c0": VERSION}


async def test_an_engine_that_never_answered_is_asked_every_retry_and_one_that_stops_keeps_its_models(
    shared: SharedFleet, settings: Settings
) -> None:
    control = FakeControl(p0=["m-one"], d0=None)
    (sup, _), worker, now = reading(shared, settings, control), follower(shared, settings), 1000.0
    sup.tick_models(now)
    await settle(sup, now)
    assert worker.unread() == []  # d0 was asked: a starting worker does not wait for it any more
    worker.check()
    assert models_of(worker.fleet)["d0"] == set()
    sup.tick_models(now + RETRY_S / 2)
    assert len(control.reads) == 2
    control.answers["d0"] = ["m-one"]
    sup.tick_models(now + RETRY_S)
    await settle(sup, now + RETRY_S)
    assert control.reads[2:] == ["d0"]  # only the one that never answered
    worker.check()
    assert models_of(worker.fleet)["d0"] == {"m-one"}
    control.answers["p0"] = None
    sup.tick_models(now + REFRESH_S)
    await settle(sup, now + REFRESH_S)
    assert sorted(control.reads[3:]) == ["d0", "p0"]  # every engine, now and then
    worker.check()
    assert models_of(worker.fleet)["p0"] == {"m-one"}  # unreachable, it keeps what it answered


async def test_the_generate_question_is_asked_once_per_engine_process_not_per_read(
    shared: SharedFleet, settings: Settings
) -> None:
    """vLLM logs each question (an empty body on /inference/v1/generate) as a 400: asked at the
    first read, again only when the version moved or the engine came back, never per read."""
    control = FakeControl(p0=["m-one"], d0=["m-one"])
    sup, reader = reading(shared, settings, control)
    now = 1000.0
    sup.tick_models(now)
    await settle(sup, now)
    assert sorted(control.generate_asks) == ["c0", "d0", "p0"]
    sup.tick_models(now + REFRESH_S)
    await settle(sup, now + REFRESH_S)
    assert control.version_reads.count("p0") == control.version_reads.count("d0") == 2  # read again, not asked
    assert len(control.generate_asks) == 3
    control.answers["p0"] = None  # a busy engine: no /version this time, so nothing says it moved
    sup.tick_models(now + 2 * REFRESH_S)
    await settle(sup, now + 2 * REFRESH_S)
    assert control.version_reads.count("p0") == 3 and len(control.generate_asks) == 3
    control.answers["p0"] = ["m-one"]
    reader.reread(sup.fleet.by_name["d0"])  # it answers again after refusing connections: a new process
    sup.tick_models(now + REFRESH_S + 0.1)
    await settle(sup)
    assert control.generate_asks[3:] == ["d0"]


async def test_a_readmitted_engine_is_read_again_through_the_loop_and_its_new_model_seen(
    shared: SharedFleet, settings: Settings
) -> None:
    sup = Supervisor(shared, settings)
    control = FakeControl(p0=["m-one"], d0=["m-one"])
    loop = Loop.start(sup, FakeProber(), LoadReader(shared, PooledReader(settings.engine, 1.0)))  # type: ignore[arg-type]
    sup.read_models(ModelReader(control, sup.rounds, settings.recovery.health_interval_s))
    worker = follower(shared, settings)
    loop.step()
    await settle(sup)
    now = time.monotonic()
    sup.breakers.eject("d0", now)  # out: restarted with another model meanwhile
    control.answers["d0"] = ["m-two"]
    loop.step()
    await settle(sup)
    assert sorted(control.reads) == ["d0", "p0"]  # not read while out
    sup.breakers.readmit("d0", now)
    # Read again once its pace allows (a round per engine per health_interval_s, 1 s here).
    end = time.monotonic() + 5
    while sorted(control.reads) != ["d0", "d0", "p0"] and time.monotonic() < end:
        loop.step()
        await settle(sup)
        await asyncio.sleep(0.05)
    loop.step()  # the pass after the answer publishes it
    assert sorted(control.reads) == ["d0", "d0", "p0"]  # the readmitted one only
    worker.check()
    assert models_of(worker.fleet) == {"p0": {"m-one"}, "d0": {"m-two"}, "c0": {"fixed"}}


async def test_a_bound_that_bites_is_logged_once_per_change_of_the_answer(
    shared: SharedFleet, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    long = "x" * (M.MAX_MODEL_BYTES + 1)
    control = FakeControl(p0=["m-one", long], d0=["m-one"])
    (sup, _), worker = reading(shared, settings, control), follower(shared, settings)
    caplog.set_level(logging.INFO, "narwhal.supervisor.models")
    for now in (0.0, REFRESH_S, 2 * REFRESH_S):  # the same answer three times
        sup.tick_models(now)
        await settle(sup, now)
    refused = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert refused == [f"engine p0: 1 model name(s) over {M.MAX_MODEL_BYTES} bytes left out ('{'x' * 40}...')"]
    worker.check()
    assert models_of(worker.fleet)["p0"] == {"m-one"}


async def test_a_restarted_supervisor_starts_from_what_its_predecessor_published(
    shared: SharedFleet, settings: Settings
) -> None:
    first, _ = reading(shared, settings, FakeControl(p0=["m-one"], d0=["m-two"]))
    first.tick_models(0.0)
    await settle(first, 0.0)
    again, _ = reading(shared, settings, FakeControl())  # the engines do not answer it
    assert models_of(again.fleet)["d0"] == {"m-two"}  # its own probes pick from them at once
    again.tick_models(0.0)  # its first round is published at once, before any read ended
    worker = follower(shared, settings)
    assert worker.unread() == []
    worker.check()
    assert models_of(worker.fleet) == {"p0": {"m-one"}, "d0": {"m-two"}, "c0": {"fixed"}}
    await settle(again, 0.0)
    p0 = shared.engine_slot("p0", "http://127.0.0.1:1")
    assert p0 is not None
    assert M.read_models(shared.region, p0) == M.ModelsRecord(
        M.generation(shared.region), record_hash("p0", "http://127.0.0.1:1"), M.ANSWERED, ("m-one",), VERSION,
        M.GENERATE_SERVED)


async def test_an_engine_refusing_generate_reaches_the_workers_and_a_silent_one_keeps_its_word(
    shared: SharedFleet, settings: Settings
) -> None:
    """docs/decisions.md "vLLM releases": an engine answering 403 on ``/inference/v1/generate`` is published with its
    models; a worker's engine carries it (``/admin/engines``); no answer keeps the last word, and
    a restart with ``--enable-scale-out`` clears it at the next read."""
    control = FakeControl(p0=["m-one"], d0=["m-one"])
    control.refusing = {"d0"}
    sup, reader = reading(shared, settings, control)
    worker = follower(shared, settings)
    now = time.monotonic()
    sup.tick_models(now)
    await settle(sup, now)
    worker.check()
    assert {e.name: e.generate_refused for e in worker.fleet.engines} == {"p0": False, "d0": True, "c0": False}
    d0 = sup.fleet.by_name["d0"]
    reader.settle_generate(d0, None)  # no answer this time: it still refuses
    sup.tick_models(now)
    worker.check()
    assert worker.fleet.by_name["d0"].generate_refused
    reader.settle_generate(d0, False)  # restarted with --enable-scale-out
    sup.tick_models(now)
    worker.check()
    assert not worker.fleet.by_name["d0"].generate_refused


async def test_an_engine_answering_again_is_reachable_and_read_again_at_once_and_once(
    shared: SharedFleet, settings: Settings
) -> None:
    """docs/behaviour.md: reachable means it answered (any status); an engine that becomes
    reachable has its /version and models read at once (it takes traffic as soon as it is
    admitted, not a health interval later), and once however many control reads see it (before
    the pace: every load read, ten a second, started another round); a /version it cannot give
    leaves its version unknown, not the engine unreachable."""
    control = FakeControl(p0=["m-one"], d0=["m-one"])
    sup, _ = reading(shared, settings, control)
    d0 = sup.fleet.by_name["d0"]
    now = 1000.0
    sup.tick_models(now)
    await settle(sup, now)
    assert d0.version == VERSION and control.version_reads.count("d0") == 1
    sup.checks.connected(d0, answered=False, refused=True)  # a stopped process
    assert sup.reach.unreachable("d0")
    control.answers["d0"] = None  # the new process answers its /health, not its /version
    for step in range(10):  # ten control reads within the pace (health_interval_s is 1 s here)
        sup.checks.connected(d0, answered=True, refused=False)
        assert not sup.reach.unreachable("d0")  # any answer: reachable
        sup.tick_models(now + 0.2 + step * 0.07)
        await settle(sup)
    assert control.version_reads.count("d0") == 2  # at once, though its last round was under 1 s ago; once
    assert d0.version is None and not sup.reach.unreachable("d0")  # unknown, and reachable


def test_an_engine_answering_again_after_refusing_connections_is_forgotten_by_placement(
    shared: SharedFleet, settings: Settings
) -> None:
    """A restarted consumer's cache is empty, and nothing else says so (no descriptor names its
    process): what placement learned it holds goes when it answers again after refusing
    connections (docs/behaviour.md "Placement": follow-up turns)."""
    region = create_policy_region(settings, 2, len(settings.engines))
    sup = Supervisor(shared, settings, policy_region=region)
    assert isinstance(sup.part, HoldingsPart)
    d0 = sup.fleet.by_name["d0"]
    sup.part.model.consumer_keys[d0.index] = OrderedDict.fromkeys([1, 2, 3])
    sup.checks.connected(d0, answered=True, refused=False)  # reachable all along: kept
    assert list(sup.part.model.consumer_keys[d0.index]) == [1, 2, 3]
    sup.checks.connected(d0, answered=False, refused=True)  # a stopped process
    assert d0.index in sup.part.model.consumer_keys  # unreachable alone says nothing of its cache
    sup.checks.connected(d0, answered=True, refused=False)  # a new one answers
    assert d0.index not in sup.part.model.consumer_keys


def test_a_readmission_by_probe_marks_the_engine_reachable(shared: SharedFleet, settings: Settings) -> None:
    sup = Supervisor(shared, settings)
    sup.reach.saw("d0", False)

    class Passing:
        async def probe(self, *args: object) -> tuple[str, str]:
            return "pass", ""

    async def run() -> None:
        plan = type("Plan", (), {"engine": "d0", "kind": "probe", "as_producer": False, "as_consumer": True,
                                 "producer": None})()
        await sup.checks._probe(Passing(), sup.fleet.by_name["d0"], plan)  # type: ignore[arg-type]

    asyncio.run(run())
    assert not sup.reach.unreachable("d0")
