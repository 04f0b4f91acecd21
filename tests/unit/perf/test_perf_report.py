"""The perf report's targets: the issue's thresholds, and the same promises scaled to this host."""

from __future__ import annotations

from typing import Any

from perf.report.results import evaluate_targets


def _target(router_cpu: float, ratio: float, ttfb_added: float) -> dict[str, Any]:
    return {"router_cpu_us_per_req": router_cpu, "vs_direct": {"rps_ratio": ratio, "ttfb_p50_added_ms": ttfb_added}}


def _results(narwhal_cpu: float, *, peer: bool = True) -> dict[str, Any]:
    def scenario(**targets: dict[str, Any]) -> dict[str, Any]:
        return {"targets": targets}

    peer_targets = {"peer": _target(783.0, 0.25, 1.973)} if peer else {}
    return {
        "stream_c32": scenario(narwhal=_target(narwhal_cpu, 0.27, 0.0), **peer_targets),
        "stream_c1": scenario(narwhal=_target(1100.0, 0.29, 1.925), **peer_targets),
        "paced_c128": scenario(narwhal=_target(1400.0, 0.602, 50.0), **{"direct-pd": _target(0, 0.619, 45.0)}),
    }


def _row(rows: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    return next(r for r in rows if r["target"].startswith(prefix))


def test_thresholds_are_scaled_by_the_peer_of_the_same_run() -> None:
    rows = evaluate_targets(_results(924.0))
    cpu = _row(rows, "router CPU")
    assert (cpu["result"], cpu["host_result"]) == ("FAIL", "PASS")
    assert cpu["host_threshold"].startswith("≤ 1,620 µs")  # 600 × 783 / 290
    ttfb = _row(rows, "added TTFB")
    assert (ttfb["result"], ttfb["host_result"]) == ("FAIL", "PASS")  # 1.925 ≤ 0.6 × 1.973 / 0.57 = 2.077
    paced = _row(rows, "paced decode 10 ms")
    assert (paced["result"], paced["host_result"]) == ("FAIL", "PASS")  # 0.602 ≥ 0.97 × 0.619 = 0.600
    throughput = _row(rows, "throughput")
    assert (throughput["result"], throughput["host_result"]) == ("PASS", "PASS")


def test_a_router_dearer_than_the_scaled_threshold_fails_here_too() -> None:
    cpu = _row(evaluate_targets(_results(1700.0)), "router CPU")
    assert (cpu["result"], cpu["host_result"]) == ("FAIL", "FAIL")


def test_without_a_peer_the_host_verdict_is_not_guessed() -> None:
    rows = evaluate_targets(_results(924.0, peer=False))
    cpu = _row(rows, "router CPU")
    assert cpu["host_result"] == "n/a" and cpu["host_threshold"] == "n/a (needs --peer)"
    assert _row(rows, "paced decode 10 ms")["host_result"] == "PASS"  # the PD floor needs no peer


def test_cpu_against_the_peer_is_judged_per_scenario_at_0_9() -> None:
    rows = evaluate_targets(_results(700.0))  # 700 / 783 = 0.894 at c=32; c=1: 1100 / 783 = 1.405
    c32 = _row(rows, "router CPU per request ×peer, stream_c32")
    assert (c32["narwhal"], c32["result"]) == (0.894, "PASS")
    c1 = _row(rows, "router CPU per request ×peer, stream_c1")
    assert (c1["narwhal"], c1["result"]) == (1.405, "FAIL")
    assert _row(rows, "router CPU per request ×peer, chat_long")["result"] == "n/a"  # did not run
    assert _row(evaluate_targets(_results(700.0, peer=False)), "router CPU per request ×peer, stream_c32")[
        "result"] == "n/a"


def test_a_long_prompt_may_cost_at_most_15_percent_over_a_short_one() -> None:
    results = _results(700.0)
    results["chat_c32"] = {"targets": {"narwhal": _target(600.0, 0.3, 0.0)}}
    results["chat_long"] = {"targets": {"narwhal": _target(690.0, 0.3, 0.0)}}
    row = _row(evaluate_targets(results), "router CPU per request, chat_long ×chat_c32")
    assert (row["narwhal"], row["result"]) == (1.15, "PASS")
    results["chat_long"]["targets"]["narwhal"]["router_cpu_us_per_req"] = 700.0
    row = _row(evaluate_targets(results), "router CPU per request, chat_long ×chat_c32")
    assert (row["narwhal"], row["result"]) == (1.167, "FAIL")
