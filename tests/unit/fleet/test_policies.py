"""The producer policies behind one interface (``fleet.placement.policy``, ``.registry``): the
settings' choices are the registry's names, each policy keeps what its rule needs of a request
(its note) and asks for the shared memory it needs, saturation is set aside once for every
policy, and ``prefix_affinity`` is a deprecated alias said once."""

from __future__ import annotations

import logging
import random
from typing import Any, get_args

import pytest

from narwhal.fleet import Engine
from narwhal.fleet.placement import affinity
from narwhal.fleet.placement.affinity import Affinity
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.fleet.placement.held import Held
from narwhal.fleet.placement.least_loaded import LeastLoaded
from narwhal.fleet.placement.policy import Asked, Candidate, Ordered, split_saturated
from narwhal.fleet.placement.registry import POLICIES, build, region
from narwhal.settings import PlacementSettings
from narwhal.settings import placement as settings_module


class _Loads:
    """Just what the saturation filter reads of ``load.Loads``."""

    def __init__(self, saturated: list[bool]) -> None:
        self.saturated = saturated
        self.any_saturated = any(saturated)


def _candidates(n: int) -> list[Candidate]:
    engines = [Engine(index=i, name=f"p{i}", url=f"http://127.0.0.1:{9000 + i}", role="producer", can_prefill=True,
                      can_decode=False, connector="NixlConnector", wave=None, max_inflight_prefill=None,
                      max_inflight_decode=None, peers=None) for i in range(n)]
    return [(e, ()) for e in engines]


def test_the_settings_choices_are_the_registrys_names() -> None:
    assert set(get_args(PlacementSettings.model_fields["policy"].annotation)) == set(POLICIES)
    for name in POLICIES:
        assert build(PlacementSettings(policy=name)).name == name  # type: ignore[arg-type]


class _Prompt:
    """A prompt of ``text`` (no turns) that records each length a policy read it to."""

    def __init__(self, text: str | None, read: list[int]) -> None:
        self.text, self.read = text, read

    def __call__(self, limit: int) -> str | None:
        self.read.append(limit)
        return None if self.text is None else self.text[:limit]

    def answer_span(self, limit: int) -> tuple[int, int] | None:
        return None


def _prompt(text: str | None, read: list[int]) -> Any:
    return _Prompt(text, read)


def test_each_policy_keeps_what_its_rule_needs_of_the_prompt_and_nothing_more() -> None:
    settings = PlacementSettings()
    long, medium, short = "s" * 600, "m" * 100, "x" * 10
    read: list[int] = []
    assert LeastLoaded(settings).prepare(_prompt(long, read)) is None and read == []  # never read
    assert Affinity(settings).prepare(_prompt(long, read)) == affinity.key_hash(long[: settings.affinity_chars])
    assert read == [settings.affinity_chars]  # no more than the key's characters
    assert Affinity(settings).prepare(_prompt(short, read)) is None  # under affinity_min_chars: no key
    policy = Held(settings)
    blocks = policy.prepare(_prompt(long, read))
    assert isinstance(blocks, PrefixBlocks) and blocks.count == 600 // settings.held.block_chars
    assert read[-1] == settings.held.max_prefix_chars + 1  # one past: a cut prompt is told from a whole one
    assert policy.prepare(_prompt(medium, read)) == affinity.key_hash(medium)  # no full block: the key
    assert policy.prepare(_prompt(short, read)) is None
    assert policy.prepare(_prompt(None, read)) is None  # an endpoint without prompt text


def test_only_held_asks_the_master_for_shared_memory() -> None:
    settings = PlacementSettings(held={"holdings_slots": 4096})  # type: ignore[arg-type]
    need = region(PlacementSettings(policy="held", held=settings.held))
    assert need is not None and (need.keys, need.entry_keys) == (4096, 256)
    assert (need.create, need.worker, need.supervisor) == (
        "narwhal.shm.holdings:create_region", "narwhal.shm.holdings_view:worker_view",
        "narwhal.supervisor.holdings.part:HoldingsPart")
    assert {name: cls.region(settings) is None for name, cls in POLICIES.items()} == {
        "held": False, "affinity": True, "least_loaded": True}
    assert isinstance(build(PlacementSettings(policy="held")), Held)
    assert isinstance(build(PlacementSettings(policy="affinity")), Affinity)
    assert isinstance(build(PlacementSettings(policy="least_loaded")), LeastLoaded)


def test_saturation_is_set_aside_once_unless_the_policy_keeps_it_or_every_candidate_is_saturated() -> None:
    cands = _candidates(4)
    loads: Any = _Loads([False, True, False, True])
    front, rest, every = split_saturated(cands, loads, None)
    assert ([c[0].name for c in front], [c[0].name for c in rest], every) == (["p0", "p2"], ["p1", "p3"], False)
    front, rest, every = split_saturated(cands, loads, lambda c: c[0].name == "p3")  # held: p3 holds the prompt
    assert ([c[0].name for c in front], [c[0].name for c in rest]) == (["p0", "p2", "p3"], ["p1"])
    front, rest, every = split_saturated(cands, _Loads([True] * 4), None)  # type: ignore[arg-type]
    assert (len(front), rest, every) == (4, [], True)
    assert split_saturated(cands, None, None) == (cands, [], False)


def test_a_policy_orders_only_what_it_is_given_and_labels_its_choice() -> None:
    cands = _candidates(3)
    settings = PlacementSettings()
    asked = Asked(load=lambda c: [5, 1, 3][c[0].index], loads=None, note=None,
                  hashes=[affinity.key_hash(c[0].name) for c in cands], rng=random.Random(1), settings=settings)
    ordered = LeastLoaded(settings).order(list(cands), asked)
    assert isinstance(ordered, Ordered) and [c[0].name for c in ordered.candidates] == ["p1", "p2", "p0"]
    assert ordered.choice(0, ordered.candidates[0][0]) == "least_loaded" and ordered.kept is None
    asked.note = key = affinity.key_hash("a long shared system prompt")
    asked.load = lambda c: 1  # every producer within the bound: the rendezvous rank alone
    keyed = Affinity(settings).order(list(cands), asked)
    favourite = affinity.rank([c[0].name for c in cands], key, affinity.key_hash)[0]
    assert keyed.candidates[0][0].name == favourite and keyed.choice(0, keyed.candidates[0][0]) == "affinity"
    # held without a block to go by: the affinity rule, as the key says
    assert [c[0].name for c in Held(settings).order(list(cands), asked).candidates] == [
        c[0].name for c in keyed.candidates]


def test_prefix_affinity_is_a_deprecated_alias_said_once(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(settings_module, "_DEPRECATION_SAID", [])
    with caplog.at_level(logging.WARNING, logger="narwhal.settings"):
        assert PlacementSettings(prefix_affinity=False).placement_policy == "least_loaded"
        assert PlacementSettings(prefix_affinity=True, policy="affinity").placement_policy == "affinity"
        assert PlacementSettings(policy="held").placement_policy == "held"
    lines = [r.getMessage() for r in caplog.records if r.name == "narwhal.settings"]
    assert lines == ['placement.prefix_affinity is deprecated: placement.policy chooses the producer rule '
                     '(false means policy = "least_loaded")']
