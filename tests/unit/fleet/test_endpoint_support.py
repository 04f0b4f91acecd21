"""Endpoints per release (docs/behaviour.md, "Endpoints per release"): how a model's engines can
serve a P/D endpoint, from their vLLM versions (``narwhal.fleet.endpoint_support``)."""

from __future__ import annotations

import pytest

from narwhal.fleet import compat
from narwhal.fleet.endpoint_support import LOCAL, NONE, PD, EndpointSupport
from tests.unit.fleet.placement_support import MODEL, build

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/inference/v1/generate"]


def _support(versions: dict[str, str | None], roles: dict[str, str] | None = None) -> EndpointSupport:
    roles = roles or {"p0": "producer", "d0": "consumer"}
    placement, *_ = build([{"name": n, "role": r} for n, r in roles.items()])
    fleet = placement.fleet
    for engine in fleet.engines:
        fleet.set_version(engine, versions.get(engine.name))
    return EndpointSupport(fleet)


def test_0_11_hands_off_on_chat_and_completions_only() -> None:
    support = _support({"p0": "0.11.0", "d0": "0.11.0"})
    assert [support.of(MODEL, p) for p in PATHS] == [PD, PD, LOCAL, NONE, NONE]


@pytest.mark.parametrize("version", ["0.21.0", "0.33.0", "0.34.0", None])
def test_later_and_unknown_releases_hand_off_everywhere(version: str | None) -> None:
    support = _support({"p0": version, "d0": version})
    assert {support.of(MODEL, p) for p in PATHS} == {PD}


def test_a_both_engine_on_0_11_serves_what_it_has_a_route_for() -> None:
    support = _support({"b0": "0.11.0"}, {"b0": "both"})
    assert [support.of(MODEL, p) for p in PATHS] == [PD, PD, PD, NONE, NONE]


def test_the_answer_follows_a_version_change() -> None:
    support = _support({"p0": "0.11.0", "d0": "0.11.0"})
    assert support.of(MODEL, "/v1/messages") == NONE
    fleet = support.fleet
    for engine in fleet.engines:
        fleet.set_version(engine, "0.33.0")
    assert support.of(MODEL, "/v1/messages") == PD


def test_the_release_facts() -> None:
    assert compat.hands_off("0.11.2", "/v1/chat/completions") and not compat.hands_off("0.11.0", "/v1/responses")
    assert compat.has_route("0.11.0", "/v1/responses") and not compat.has_route("0.11.0", "/v1/messages")
    assert compat.hands_off(None, "/v1/messages") and compat.has_route("0.12.0", "/inference/v1/generate")


@pytest.mark.parametrize("engines", [
    [{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer", "kv_connector": "MooncakeConnector"}],
    [{"name": "d0", "role": "consumer"}],
])
def test_a_model_with_no_permitted_pair_is_never_served_by_a_consumer_alone(engines: list[dict]) -> None:
    """Connectors (or roles) that cannot pair: placement's 503 no_engine, never a local decode on
    consumers sized for decode."""
    placement, *_ = build(engines)
    support = EndpointSupport(placement.fleet)
    assert {support.of(MODEL, p) for p in PATHS} == {PD}
    assert not placement.has_pair(MODEL)
