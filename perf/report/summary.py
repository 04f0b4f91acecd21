"""Pool one scenario's rounds into the figures the report shows, and relate targets to each other.

Every figure comes from the rounds of one run: a target's rounds are pooled (requests over the
sum of the windows, percentiles over every sample), so a round with a longer window weighs more,
as it measured more. Ratios to ``direct`` are taken between pooled figures, the per-round ratios
kept beside them as a record of the spread; ratios to ``--baseline`` are the *median of per-round
ratios* instead, because the two ran back to back in every round, so the host's drift between
rounds cancels out of each ratio.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from narwhal.sizing import recommend
from perf.load.generator import RoundResult, percentile
from perf.load.stack import Target


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def _us_per(cpu_s: float, requests: int) -> float | None:
    return round(cpu_s * 1e6 / requests, 1) if requests else None


def summarize(target: Target, rounds: list[RoundResult], cores: int) -> dict[str, Any]:
    """Pool one target's rounds into the figures of the report."""
    requests = sum(r.requests for r in rounds)
    window = sum(r.window_s for r in rounds) or 1e-9
    tokens = sum(r.tokens for r in rounds)
    ttfb = [x for r in rounds for x in r.ttfb]
    latency = [x for r in rounds for x in r.latency]
    errors: Counter[str] = Counter()
    for r in rounds:
        errors.update(r.errors)
    router_cpu = sum(r.cpu.get(target.name, 0.0) for r in rounds) if target.pids else 0.0
    engine_cpu = sum(r.cpu.get("producer", 0.0) + r.cpu.get("consumer", 0.0) for r in rounds)
    ours = sum(sum(r.cpu.values()) + r.client_cpu for r in rounds)
    groups = sorted({g for r in rounds for g in r.cpu})
    cores_used = {g: round(sum(r.cpu.get(g, 0.0) for r in rounds) / window, 3) for g in groups}
    cores_used["client"] = round(sum(r.client_cpu for r in rounds) / window, 3)
    host = {k: sum(r.host.get(k, 0.0) for r in rounds) for k in ("tasks", "irq", "steal", "total")}
    capacity = window * cores
    return {
        "target": target.name,
        "kind": target.kind,
        "requests": requests,
        "window_s": round(window, 3),
        "rps": round(requests / window, 2),
        "tokens_per_s": round(tokens / window, 1),
        "ttfb_ms": {"p50": _ms(percentile(ttfb, 50)), "p99": _ms(percentile(ttfb, 99))},
        "latency_ms": {"p50": _ms(percentile(latency, 50)), "p99": _ms(percentile(latency, 99))},
        "errors": {"count": sum(errors.values()), "by_status": dict(sorted(errors.items()))},
        "router_cpu_us_per_req": _us_per(router_cpu, requests) if target.pids else None,
        "router_cpu_by_process_us_per_req": {
            role: _us_per(sum(r.cpu_roles.get(target.name, {}).get(role, 0.0) for r in rounds), requests)
            for role in sorted({x for r in rounds for x in r.cpu_roles.get(target.name, {})})
        }
        if target.pids
        else None,
        "engine_cpu_us_per_req": _us_per(engine_cpu, requests),
        "producer_cpu_us_per_req": _us_per(sum(r.cpu.get("producer", 0.0) for r in rounds), requests),
        "consumer_cpu_us_per_req": _us_per(sum(r.cpu.get("consumer", 0.0) for r in rounds), requests),
        "client_cpu_us_per_req": _us_per(sum(r.client_cpu for r in rounds), requests),
        "host_busy_pct": round(100.0 * (host["tasks"] + host["irq"]) / capacity, 1),
        "irq_pct": round(100.0 * host["irq"] / capacity, 1),
        "steal_pct": round(100.0 * host["steal"] / capacity, 1),
        "other_cpu_pct": round(100.0 * max(0.0, host["tasks"] - ours) / capacity, 1),
        "cores_used": cores_used,
        "rounds_rps": [round(r.requests / r.window_s, 1) if r.window_s else 0.0 for r in rounds],
        "detail": dict(target.detail),
    }


def compare(stats: dict[str, dict[str, Any]], rounds: dict[str, list[RoundResult]]) -> None:
    """Add ratios to "direct" (same run) to every other target's figures, in place."""
    direct = stats.get("direct")
    if direct is None:
        return
    direct_rounds = rounds.get("direct", [])
    for name, s in stats.items():
        if name == "direct":
            continue
        s["vs_direct"] = ratios(s, direct)
        per_round = [
            (a.requests / a.window_s) / (b.requests / b.window_s)
            for a, b in zip(rounds.get(name, []), direct_rounds, strict=False)
            if a.window_s and b.window_s and b.requests
        ]
        s["vs_direct"]["rps_ratio_rounds"] = [round(x, 3) for x in per_round]


def against_baseline(stats: dict[str, dict[str, Any]], rounds: dict[str, list[RoundResult]]) -> None:
    """``--baseline``: Narwhal over the baseline, as the median of per-round ratios (the two
    ran back to back in every round, so host drift between rounds cancels out), in place."""
    mine, base = rounds.get("narwhal", []), rounds.get("baseline", [])
    if "narwhal" not in stats or not base:
        return

    def cpu_per_req(r: RoundResult, name: str) -> float | None:
        return r.cpu.get(name, 0.0) / r.requests if r.requests else None

    cpu: list[float] = []
    rps: list[float] = []
    for a, b in zip(mine, base, strict=False):
        ca, cb = cpu_per_req(a, "narwhal"), cpu_per_req(b, "baseline")
        if ca is not None and cb:
            cpu.append(ca / cb)
        if a.window_s and b.window_s and b.requests:
            rps.append((a.requests / a.window_s) / (b.requests / b.window_s))
    ttfb, base_ttfb = stats["narwhal"]["ttfb_ms"]["p50"], stats["baseline"]["ttfb_ms"]["p50"]
    stats["narwhal"]["vs_baseline"] = {
        "cpu_ratio": round(statistics.median(cpu), 3) if cpu else None,
        "rps_ratio": round(statistics.median(rps), 3) if rps else None,
        "cpu_ratio_rounds": [round(x, 3) for x in cpu],
        "rps_ratio_rounds": [round(x, 3) for x in rps],
        "ttfb_p50_diff_ms": round(ttfb - base_ttfb, 3) if ttfb is not None and base_ttfb is not None else None,
    }


def ratios(s: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    def diff(a: float | None, b: float | None) -> float | None:
        return round(a - b, 3) if a is not None and b is not None else None

    return {
        "rps_ratio": ratio(s["rps"], d["rps"]),
        "tokens_ratio": ratio(s["tokens_per_s"], d["tokens_per_s"]),
        "ttfb_p50_added_ms": diff(s["ttfb_ms"]["p50"], d["ttfb_ms"]["p50"]),
        "ttfb_p99_added_ms": diff(s["ttfb_ms"]["p99"], d["ttfb_ms"]["p99"]),
        "latency_p50_ratio": ratio(s["latency_ms"]["p50"], d["latency_ms"]["p50"]),
        "latency_p99_ratio": ratio(s["latency_ms"]["p99"], d["latency_ms"]["p99"]),
    }



def recommend_workers(stats: dict[str, dict[str, Any]]) -> int | None:
    """The smallest worker count whose throughput is within 5 % of the best (``narwhal workers``'
    rule, ``narwhal.sizing.recommend``)."""
    rates = {int(k.removeprefix("narwhal-w")): v["rps"] for k, v in stats.items() if k.startswith("narwhal-w")}
    return recommend(rates)
