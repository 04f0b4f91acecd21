"""The report's notes: when the fake engines, the host or other people's processes set the limit.

On a 2-core shared host most of what limits a figure is not the router, and a reader who sees a
low ×direct without being told so blames the router. Each note is stated only when the figures
of this run show its cause (thresholds below), names the scenarios it applies to, and says what
to compare with instead. The order is fixed (the engines' cost, the aiohttp floor, then the
host's limits), so two runs' notes can be compared line by line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from perf.report.figures import figure

CONSUMER_BOUND_CORES = 0.85  # the fake consumer is one process: near one core, it is the limit
PACED_SHORTFALL = 0.9  # paced direct baseline below this share of its pacing ceiling
SATURATED_PCT = 95  # host busy, all processes counted
NOISY_PCT = 10  # host CPU used by processes outside this suite


def notes(results: dict[str, Any], cores: int) -> list[str]:
    """Say when the fake engine, the host or other people's processes, not the router, set the limit."""
    out: list[str] = []
    engine = _engine_cpu_note(results)
    if engine:
        out.append(engine)
    floor = _floor_note(results)
    if floor:
        out.append(floor)
    return out + _host_notes(_HostLimits.scan(results), cores)


def _engine_cpu_note(results: dict[str, Any]) -> str | None:
    """stream_c32: what the fake engines spend behind a PD router, against direct."""
    ref = results.get("stream_c32", {}).get("targets", {})
    if not (ref.get("narwhal") and ref.get("direct") and ref["direct"]["engine_cpu_us_per_req"]):
        return None
    n, d = ref["narwhal"]["engine_cpu_us_per_req"], ref["direct"]["engine_cpu_us_per_req"]
    return (
        f"stream_c32: the fake engines spent {n:,.0f} µs per request behind the router vs {d:,.0f} µs direct "
        "(a prefill leg, and the consumer's KV read from the producer over HTTP between the two fleet "
        "processes): on a small host that CPU, not the router's, is much of why ×direct is low — compare "
        "with the peer, which pays the same."
    )


def _floor_note(results: dict[str, Any]) -> str | None:
    """Narwhal next to the aiohttp floor (and the peer) where the floor ran."""
    parts = []
    for name, what, path, unit in (
        ("stream_c1", "added TTFB p50", ("vs_direct", "ttfb_p50_added_ms"), "ms"),
        ("stream_c32", "router CPU", ("router_cpu_us_per_req",), "µs/request"),
        ("nonstream_c32", "router CPU", ("router_cpu_us_per_req",), "µs/request"),
    ):
        figures = [figure(results, name, t, *path) for t in ("narwhal", "aiohttp-floor", "peer")]
        if figures[0] is not None and figures[1] is not None:
            shown = [f"{v:.3f}" if unit == "ms" else f"{v:,.0f}" for v in figures if v is not None]
            peer = f", the peer {shown[2]}" if len(shown) == 3 else ""
            parts.append(f"{name} {what}: Narwhal {shown[0]}, the aiohttp floor {shown[1]}{peer} {unit}")
    if not parts:
        return None
    return (
        "aiohttp floor (`perf/load/floor_proxy.py`: gunicorn + aiohttp + Narwhal's engine client and nothing "
        "else): " + "; ".join(parts) + ". What the floor adds over the PD floor is the framework's "
        "cost; what Narwhal adds over the floor is its features'."
    )


@dataclass(slots=True)
class _HostLimits:
    """The scenarios (with the figure that put them there) where the host, not the router, set the limit."""

    engine_bound: list[str] = field(default_factory=list)
    unpaced: list[str] = field(default_factory=list)
    saturated: list[str] = field(default_factory=list)
    noisy: list[str] = field(default_factory=list)

    @classmethod
    def scan(cls, results: dict[str, Any]) -> _HostLimits:
        limits = cls()
        for name, res in results.items():
            if res.get("kind") not in ("load", "sweep") or not res.get("targets"):
                continue
            direct = res["targets"].get("direct")
            if direct and direct["cores_used"].get("consumer", 0) >= CONSUMER_BOUND_CORES:
                limits.engine_bound.append(f"{name} ({direct['cores_used']['consumer']:.2f})")
            ceiling = res.get("ceiling_rps")
            if direct and ceiling and direct["rps"] < PACED_SHORTFALL * ceiling:
                limits.unpaced.append(f"{name} ({100 * direct['rps'] / ceiling:.0f}% of {ceiling:.0f} req/s)")
            busy = max(s["host_busy_pct"] for s in res["targets"].values())
            if busy >= SATURATED_PCT:
                limits.saturated.append(name)
            other = max(s["other_cpu_pct"] for s in res["targets"].values())
            if other >= NOISY_PCT:
                limits.noisy.append(f"{name} ({other:.0f}%)")
        return limits


def _host_notes(limits: _HostLimits, cores: int) -> list[str]:
    out: list[str] = []
    if limits.engine_bound:
        out.append(
            "the fake consumer used most of a core in the direct baseline of "
            + ", ".join(limits.engine_bound)
            + ": one fleet process can use one core at most, so that baseline is engine-bound."
        )
    if limits.unpaced:
        out.append(
            "paced direct baseline below its pacing ceiling (concurrency / stream time) in "
            + ", ".join(limits.unpaced)
            + ": the host's CPU, not the 10 ms/token pacing, set the limit."
        )
    if limits.saturated:
        out.append(
            f"host CPU ≥ {SATURATED_PCT}% busy ({cores} cores shared by router, engines and load generator) in "
            + ", ".join(limits.saturated)
            + ": throughput there is CPU-bound, so ratios to direct mostly "
            "compare CPU cost per request."
        )
    if limits.noisy:
        out.append(
            f"processes outside this suite used ≥ {NOISY_PCT}% of the host CPU in "
            + ", ".join(limits.noisy)
            + ": a noisy machine, treat those figures with care."
        )
    return out
