"""The wanted fleet from static engines and discovered ones (docs/behaviour.md "Engines that come and go"): pure
rules.
"""

from __future__ import annotations

from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.discovery.wanted import STATIC, change, engine_name, wanted_fleet


def spec(name: str, url: str, role: str = "producer") -> EngineSpec:
    return EngineSpec(name=name, url=url, role=role)  # type: ignore[arg-type]


def test_a_discovered_name_is_role_host_port() -> None:
    assert engine_name("producer", "http://10.0.0.5:8100") == "producer-10.0.0.5-8100"
    assert engine_name("consumer", "https://[fd00::5]:8200") == "consumer-fd00--5-8200"
    assert engine_name("both", "https://vllm.example") == "both-vllm.example-443"


def test_static_engines_come_first_and_win_their_url() -> None:
    static = [spec("p0", "http://127.0.0.1:1")]
    found = {"file": [spec("p0-again", "http://127.0.0.1:1"), spec("d0", "http://127.0.0.1:2", "consumer")]}
    wanted = wanted_fleet(static, found, set(), 8)
    assert [(m.spec.name, m.source) for m in wanted.members] == [("p0", STATIC), ("d0", "file")]
    assert wanted.refused == []


def test_a_name_taken_by_another_url_is_refused_with_one_line() -> None:
    static = [spec("p0", "http://127.0.0.1:1")]
    wanted = wanted_fleet(static, {"file": [spec("p0", "http://127.0.0.1:9")]}, set(), 8)
    assert [m.spec.url for m in wanted.members] == ["http://127.0.0.1:1"]
    assert wanted.refused == ["discovery: file: engine 'p0' at http://127.0.0.1:9 is refused: "
                              "the name is http://127.0.0.1:1's"]
    assert wanted.refused_by_source == {"file": 1}


def test_when_slots_run_out_newcomers_are_refused_not_engines_serving_now() -> None:
    a, b, c = (spec(f"p{i}", f"http://127.0.0.{i}:8000") for i in (2, 3, 4))
    wanted = wanted_fleet([], {"dns:x": [a, b, c]}, {c.url}, 2)
    assert [m.spec.name for m in wanted.members] == ["p4", "p2"]
    assert wanted.refused == ["discovery: dns:x: engine 'p3' at http://127.0.0.3:8000 is refused: "
                              "all 2 engine slots are taken (discovery.max_engines)"]


def test_the_same_url_from_two_sources_is_one_engine_of_the_first() -> None:
    a = spec("producer-127.0.0.2-8000", "http://127.0.0.2:8000")
    wanted = wanted_fleet([], {"file": [a], "dns:x": [a]}, set(), 8)
    assert [(m.spec.url, m.source) for m in wanted.members] == [(a.url, "file")]


def test_change_lists_newcomers_and_the_urls_to_drain() -> None:
    a, b = spec("a", "http://127.0.0.2:1"), spec("b", "http://127.0.0.3:1")
    wanted = wanted_fleet([], {"file": [a, b]}, {a.url, "http://127.0.0.9:1"}, 8)
    moved = change({a.url, "http://127.0.0.9:1"}, wanted)
    assert ([m.spec.name for m in moved.added], moved.removed) == (["b"], ("http://127.0.0.9:1",))
