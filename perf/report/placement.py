"""The placement scenarios in the report: their table, the issue's placement targets, one plot.

Why apart from ``perf/report/tables.py``: these scenarios compare *variants of one router* (affinity
on/off, reported load on/off, local decode on/off) rather than a router against ``direct``, and
their targets are ratios between variants of the same run. The verdicts here never fail a run,
as everywhere in the report; a scenario that did not run shows no section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perf.report.figures import figure, judged, ratio, save_plot
from perf.report.tables import Verdict, fmt, judged_section, section

NAMES = ("prefix_mix", "busy_elsewhere", "local_short")


def targets(results: dict[str, Any]) -> list[Verdict]:
    """(target, figure, threshold, verdict) for the issue's placement targets."""
    rows: list[Verdict] = []
    share = figure(results, "prefix_mix", "affinity", "cached_share")
    without = figure(results, "prefix_mix", "no-affinity", "cached_share")
    rows.append(("prefix_mix: cached share with affinity", f"{fmt(share, 3)} (without: {fmt(without, 3)})",
                 "≥ 0.8", judged(share, lambda v: v >= 0.8)))
    p50 = figure(results, "prefix_mix", "affinity", "ttfb_ms", "p50")
    r = ratio(p50, figure(results, "prefix_mix", "no-affinity", "ttfb_ms", "p50"))
    rows.append(("prefix_mix: TTFB p50, affinity ÷ none", fmt(r, 3), "≤ 0.5", judged(r, lambda v: v <= 0.5)))
    peers = [
        (s["ttfb_ms"]["p50"], t) for t, s in results.get("prefix_mix", {}).get("targets", {}).items()
        if t.startswith("peer") and s["ttfb_ms"]["p50"] is not None
    ]
    best = min(peers) if peers else (None, "peer")
    rp = ratio(p50, best[0])
    rows.append((f"prefix_mix: TTFB p50, affinity ÷ {best[1]} (its best)", fmt(rp, 3), "≤ 1",
                 judged(rp, lambda v: v <= 1.0)))
    rb = ratio(
        figure(results, "busy_elsewhere", "load-on", "ttfb_ms", "p99"),
        figure(results, "busy_elsewhere", "load-off", "ttfb_ms", "p99"),
    )
    rows.append(("busy_elsewhere: TTFB p99, load on ÷ off", fmt(rb, 3), "≤ 0.5", judged(rb, lambda v: v <= 0.5)))
    rc = ratio(
        figure(results, "local_short", "local", "router_cpu_us_per_req"),
        figure(results, "local_short", "disaggregated", "router_cpu_us_per_req"),
    )
    rows.append(("local_short: router CPU, local ÷ disaggregated", fmt(rc, 3), "≤ 0.7",
                 judged(rc, lambda v: v <= 0.7)))
    rt = ratio(
        figure(results, "local_short", "local", "ttfb_ms", "p50"),
        figure(results, "local_short", "disaggregated", "ttfb_ms", "p50"),
    )
    rows.append(("local_short: TTFB p50, local ÷ disaggregated", fmt(rt, 3), "< 1", judged(rt, lambda v: v < 1.0)))
    return rows


_HEAD = section(
    "Placement scenarios",
    "TTFB = first token as the client feels it (`first_byte_s`); router TTFT = the router's `ttft_s` "
    "(the producer's answer: the handoff is ready); cached share = the producers' cached prompt tokens "
    "÷ prompt tokens (their `/metrics` counters); CPU in µs per request.",
    "| scenario | variant | req/s | TTFB p50 ms | TTFB p99 ms | router TTFT p50 ms | router TTFT p99 ms "
    "| cached share | modes | errors | router CPU µs |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
)


def _rows(name: str, res: dict[str, Any]) -> list[str]:
    """One scenario's variants, a row each."""
    lines = []
    for variant, s in res["targets"].items():
        modes = ", ".join(f"{k}:{v}" for k, v in (s.get("modes") or {}).items()) or "—"
        lines.append(
            f"| {name} (c={res['concurrency']}) | {variant} | {fmt(s['rps'])} "
            f"| {fmt(s['ttfb_ms']['p50'], 2)} | {fmt(s['ttfb_ms']['p99'], 2)} "
            f"| {fmt(s['router_ttft_ms']['p50'], 2)} | {fmt(s['router_ttft_ms']['p99'], 2)} "
            f"| {fmt(s['cached_share'], 3)} | {modes} | {s['errors']['count']} "
            f"| {fmt(s['router_cpu_us_per_req'], 0)} |"
        )
    return lines


def table(results: dict[str, Any]) -> list[str]:
    """The placement section of ``results.md``: every variant's figures, then the targets."""
    return judged_section(results, NAMES, _HEAD, _rows, "placement", targets)


def plot(plt: Any, results: dict[str, Any], out_dir: Path) -> str | None:
    """``placement.png``: TTFB p50 and p99 of every variant, one group of bars per scenario."""
    present = [n for n in NAMES if n in results and results[n]["targets"]]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 4), squeeze=False)
    for ax, name in zip(axes[0], present, strict=True):
        variants = list(results[name]["targets"])
        p50 = [results[name]["targets"][v]["ttfb_ms"]["p50"] or 0.0 for v in variants]
        p99 = [results[name]["targets"][v]["ttfb_ms"]["p99"] or 0.0 for v in variants]
        xs = range(len(variants))
        ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="TTFB p50")
        ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="TTFB p99")
        ax.set_xticks(list(xs), variants)
        ax.set_title(name)
        ax.set_ylabel("ms")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return save_plot(plt, fig, out_dir, "placement.png")
