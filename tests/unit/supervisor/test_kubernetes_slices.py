"""EndpointSlices read as engines (docs/deploy.md "Kubernetes discovery"), pure: which endpoints are engines,
at which port and name, and which slices are refused."""

from __future__ import annotations

import pytest

from narwhal.settings.discovery import KubernetesSource
from narwhal.supervisor.discovery.kubernetes import Unshaped, endpoints_of

SOURCE = KubernetesSource(namespace="llm", producer_selector="app=p")


def _slice(*endpoints: dict, ports: list | None = None, kind: str = "IPv4") -> dict:
    default = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]
    return {"metadata": {"name": "s"}, "addressType": kind, "endpoints": list(endpoints),
            "ports": ports if ports is not None else default}


def _ep(address: str, pod: str | None = "pod-a", **conditions: bool) -> dict:
    out = {"addresses": [address], "conditions": conditions}
    if pod:
        out["targetRef"] = {"kind": "Pod", "name": pod}
    return out


def test_ready_and_unknown_readiness_are_engines_not_ready_and_terminating_are_not() -> None:
    found = endpoints_of(_slice(_ep("10.0.0.1", "a", ready=True), _ep("10.0.0.2", "b"),
                                _ep("10.0.0.3", "c", ready=False), _ep("10.0.0.4", "d", ready=True, terminating=True)),
                         "producer", SOURCE)
    assert [(e.name, e.url, e.role) for e in found] == [("a", "http://10.0.0.1:8000", "producer"),
                                                        ("b", "http://10.0.0.2:8000", "producer")]


def test_the_port_is_the_settings_else_the_named_one_else_the_only_one() -> None:
    fixed = SOURCE.model_copy(update={"port": 9000})
    assert endpoints_of(_slice(_ep("10.0.0.1")), "producer", fixed)[0].url == "http://10.0.0.1:9000"
    only = _slice(_ep("10.0.0.1"), ports=[{"name": "x", "port": 7000}])
    assert endpoints_of(only, "producer", SOURCE)[0].url == "http://10.0.0.1:7000"
    with pytest.raises(Unshaped, match="no port named 'http'"):
        endpoints_of(_slice(_ep("10.0.0.1"), ports=[{"name": "x", "port": 1}, {"name": "y", "port": 2}]), "producer",
                     SOURCE)


def test_ipv6_is_bracketed_and_an_endpoint_without_a_pod_is_named_by_its_address() -> None:
    found = endpoints_of(_slice(_ep("fd00::1", pod=None), kind="IPv6"), "consumer", SOURCE)
    assert found[0].url == "http://[fd00::1]:8000" and found[0].name.startswith("consumer-")


@pytest.mark.parametrize("raw", [
    7, {"addressType": "Bogus"}, {"addressType": "IPv4", "endpoints": 7, "ports": [{"port": 1}]},
    _slice({"addresses": []}), _slice({"addresses": ["not-an-ip"]}), _slice("x"),  # type: ignore[arg-type]
])
def test_a_slice_not_of_the_documented_shape_is_unshaped(raw: object) -> None:
    with pytest.raises(Unshaped):
        endpoints_of(raw, "producer", SOURCE)
