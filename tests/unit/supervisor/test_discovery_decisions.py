"""Discovery's decisions from what it read and the running fleet it is shown (docs/behaviour.md
"Engines that come and go"): joins, drains, readmissions, forgettings, and joins the table could
not take said once. No table and no supervisor: discovery only decides; the supervisor's loop
applies (``Supervisor.apply_membership``, through real gunicorn in the discovery integration tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from narwhal.fleet import Fleet
from narwhal.settings import Settings
from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.breaker import State
from narwhal.supervisor.discovery import Discovery
from narwhal.supervisor.membership import Drain, Forget, Join, Readmit

STATIC = {"name": "p0", "url": "http://127.0.0.1:1", "role": "producer"}


def spec(name: str, port: int, role: str = "consumer") -> EngineSpec:
    return EngineSpec(name=name, url=f"http://127.0.0.1:{port}", role=role)  # type: ignore[arg-type]


@dataclass
class View:
    """The running fleet as discovery reads it (``supervisor.discovery.decisions.Running``), changed by the
    test alone."""

    settings: Settings
    members: list[tuple[int, EngineSpec, str]]  # slot, entry, source
    states: dict[str, State] = field(default_factory=dict)
    slots: int = 8

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.settings, [(slot, s) for slot, s, _ in self.members])
        self.sources = {s.name: source for _, s, source in self.members}
        self.specs = {s.name: s for _, s, _ in self.members}

    def state(self, name: str) -> State:
        return self.states.get(name, State.ADMITTED)

    def joining(self, name: str) -> bool:
        return self.state(name) is State.PROBING


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings.model_validate({"engines": [STATIC], "discovery": {"file": str(tmp_path / "engines.toml")}})


def running(settings: Settings, *found: EngineSpec) -> View:
    members = [(0, EngineSpec(**STATIC), "static")]  # type: ignore[arg-type]
    return View(settings, members + [(i + 1, s, "file") for i, s in enumerate(found)])


def test_a_new_engine_joins_a_gone_one_drains_and_one_named_again_is_readmitted(settings: Settings) -> None:
    d0, d1 = spec("d0", 2), spec("d1", 3)
    view = running(settings, d0)
    discovery = Discovery(view, settings)
    assert discovery.last_good == {"file": [d0]}  # what the table holds from the file: its last good set
    assert discovery.decide(view) == []  # the table's set is the wanted one
    discovery.last_good["file"] = [d1]
    assert discovery.decide(view) == [Drain("d0"), Join(d1, "file")]
    assert discovery.decide(view) == [Join(d1, "file")]  # drained once; the join stands until applied
    discovery.last_good["file"] = [d0, d1]
    assert discovery.decide(view) == [Readmit("d0"), Join(d1, "file")]


def test_a_drained_engine_is_forgotten_after_two_idle_sweeps_and_a_busy_one_is_not(settings: Settings) -> None:
    view = running(settings, spec("d0", 2))
    discovery = Discovery(view, settings)
    discovery.last_good["file"] = []
    assert discovery.decide(view) == [Drain("d0")]
    view.states["d0"] = State.DRAINING
    busy, idle = [0, 0, 0, 1], [0, 0, 0, 0]  # in-flight prefills and decodes per engine slot: d0 is slot 1
    assert discovery.sweep(view, idle) == []
    assert discovery.sweep(view, busy) == []  # a leg again: the count starts over
    assert discovery.sweep(view, idle) == []
    assert discovery.sweep(view, idle) == [Forget("d0")]
    assert discovery.draining == {}


def test_an_engine_the_operator_readmitted_is_no_longer_drained_by_discovery(settings: Settings) -> None:
    view = running(settings, spec("d0", 2))
    discovery = Discovery(view, settings)
    discovery.last_good["file"] = []
    assert discovery.decide(view) == [Drain("d0")]
    assert discovery.sweep(view, [0, 0, 0, 0]) == []  # ADMITTED again: its draining count is dropped
    assert discovery.draining == {}


def test_a_join_the_table_refused_is_said_once_and_decided_again(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    view = running(settings)
    discovery = Discovery(view, settings)
    d1 = spec("d1", 3)
    discovery.last_good["file"] = [d1]
    caplog.set_level(logging.WARNING, "narwhal.discovery")
    for _ in range(3):
        decided = discovery.decide(view)
        assert decided == [Join(d1, "file")]
        discovery.refused(decided[0], "no spare slot", passing=True)  # what the loop says back
    assert [r.getMessage() for r in caplog.records] == [
        "discovery: file: engine 'd1' at http://127.0.0.1:3 is refused: no spare slot; it joins when a slot frees"]


def test_a_name_still_held_by_a_draining_engine_is_deferred_not_joined(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    view = running(settings, spec("d0", 2))
    discovery = Discovery(view, settings)
    caplog.set_level(logging.WARNING, "narwhal.discovery")
    discovery.last_good["file"] = [spec("d0", 9)]  # the same name, another URL: its old self drains first
    assert discovery.decide(view) == [Drain("d0")]
    assert caplog.records[-1].getMessage() == (
        "discovery: file: engine 'd0' at http://127.0.0.1:9 is refused: its name is still http://127.0.0.1:2's, "
        "draining; it joins when a slot frees")
