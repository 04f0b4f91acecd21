"""``prefix_scarce`` in the report: every row's figures, and the scenario's targets as PASS/FAIL lines.

Why apart from ``perf/report/placement.py``: these targets compare ``held`` with rows that are
not variants of one router (the ideal placement, the peer's best policy, two replicas), and a row
may be "not available" (a build that refuses ``policy = "held"``): its targets then say n/a
rather than failing, and the run goes on. As everywhere in the report, a verdict never fails a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from perf.report.figures import dig, judged, ratio
from perf.report.tables import Verdict, fmt, judged_section, section

NAMES = ("prefix_scarce_uniform", "prefix_scarce_zipf", "prefix_scarce_slow")
# The thresholds set for `held` on the scarce-KV scenario.
HELD_SHARE_OF_IDEAL = 0.9
TTFB_OF_IDEAL = 1.25
TTFB_OF_PEER = 0.8
REPLICA_POINTS = 5.0
SLOW_SHARE = 0.6
CPU_OF_AFFINITY = 1.05


def best_peer(rows: dict[str, Any]) -> tuple[float | None, str]:
    """The peer policy with the lowest TTFB p50, as (p50, row); (None, "peer") without one."""
    peers = [(s["ttfb_ms"]["p50"], r) for r, s in rows.items() if r.startswith("peer-") and s["ttfb_ms"]["p50"]]
    return min(peers) if peers else (None, "peer")


def _missing(res: dict[str, Any], row: str) -> str:
    """What a figure of ``row`` shows when the row did not run."""
    return str(res.get("unavailable", {}).get(row, "not run")).split(":")[0]


def _shown(value: float | None, res: dict[str, Any], *rows: str, digits: int = 3) -> str:
    if value is not None:
        return fmt(value, digits)
    absent = [r for r in rows if r not in res.get("targets", {})]
    return f"— ({absent[0]} {_missing(res, absent[0])})" if absent else "—"


def variant_targets(name: str, res: dict[str, Any]) -> list[Verdict]:
    """The targets of one variant that ran (the slow producer's two only in the slow variant)."""
    rows: dict[str, Any] = res.get("targets", {})
    out: list[Verdict] = []

    def add(what: str, value: float | None, threshold: str, ok: Callable[[float], bool], *needs: str) -> None:
        digits = 1 if what.endswith("(points)") else 3
        out.append((f"{name}: {what}", _shown(value, res, *needs, digits=digits), threshold, judged(value, ok)))

    held_share, ideal_share = dig(rows, "held", "cached_share"), dig(rows, "ideal", "cached_share")
    add("held cached share ÷ ideal's", ratio(held_share, ideal_share), f"≥ {HELD_SHARE_OF_IDEAL:g}",
        lambda v: v >= HELD_SHARE_OF_IDEAL, "held", "ideal")
    p50 = dig(rows, "held", "ttfb_ms", "p50")
    add("held TTFB p50 ÷ ideal's", ratio(p50, dig(rows, "ideal", "ttfb_ms", "p50")), f"≤ {TTFB_OF_IDEAL:g}",
        lambda v: v <= TTFB_OF_IDEAL, "held", "ideal")
    peer_p50, peer = best_peer(rows)
    add(f"held TTFB p50 ÷ {peer}'s (the peer's best)", ratio(p50, peer_p50), f"≤ {TTFB_OF_PEER:g}",
        lambda v: v <= TTFB_OF_PEER, "held", "peer-consistent_hash")
    two = dig(rows, "held-2-replicas", "cached_share")
    points = round(100.0 * (two - held_share), 1) if two is not None and held_share is not None else None
    add("two replicas' cached share − one's (points)", points, f"within ±{REPLICA_POINTS:g}",
        lambda v: abs(v) <= REPLICA_POINTS, "held", "held-2-replicas")
    cpu = ratio(dig(rows, "held", "router_cpu_us_per_req"), dig(rows, "affinity", "router_cpu_us_per_req"))
    add("held router CPU/req ÷ affinity's", cpu, f"≤ {CPU_OF_AFFINITY:g}", lambda v: v <= CPU_OF_AFFINITY,
        "held", "affinity")
    if (res.get("variant") or {}).get("slow"):
        # Prefill work (uncached prompt tokens), what a slower GPU's time goes to (README says why).
        work = dig(rows, "held", "producers", "slow_work_ratio")
        add("held: slow producer's prefill work (uncached tokens) ÷ a fast one's", work, f"≤ {SLOW_SHARE:g}",
            lambda v: v <= SLOW_SHARE, "held")
        count = dig(rows, "held", "producers", "slow_share_ratio")
        if count is not None:  # beside it, by count of prefills (not judged)
            t, f, th, v = out[-1]
            out[-1] = (t, f"{f} (prefills {fmt(count, 3)})", th, v)
        add("held TTFB p50 ÷ affinity's", ratio(p50, dig(rows, "affinity", "ttfb_ms", "p50")), "< 1",
            lambda v: v < 1.0, "held", "affinity")
    return out


def targets(results: dict[str, Any]) -> list[Verdict]:
    """Every variant's targets, in the order of ``NAMES``."""
    return [t for name in NAMES if name in results for t in variant_targets(name, results[name])]


def _producers(s: dict[str, Any]) -> str:
    per = dig(s, "producers", "per_producer") or {}
    text = " / ".join(f"{n} {p['prefills']}" for n, p in per.items()) or "—"
    count, work = dig(s, "producers", "slow_share_ratio"), dig(s, "producers", "slow_work_ratio")
    if count is None and work is None:
        return text
    return f"{text} (slow ÷ fast: prefills {fmt(count, 2)}, uncached tokens {fmt(work, 2)})"


def _row(name: str, c: int, row: str, s: dict[str, Any]) -> str:
    return (
        f"| {name} (c={c}) | {row} | {fmt(s['rps'])} | {fmt(s['ttfb_ms']['p50'], 2)} "
        f"| {fmt(s['ttfb_ms']['p99'], 2)} | {fmt(s['router_ttft_ms']['p50'], 2)} | {fmt(s['cached_share'], 3)} "
        f"| {fmt(s['router_cpu_us_per_req'], 0)} | {_producers(s)} | {s['errors']['count']} |"
    )


_HEAD = section(
    "Scarce KV (prefix_scarce)",
    "8 shared 4,000-character system prompts, 4 producers whose KV holds 2-3 of them. TTFB = first "
    "token as the client feels it; router TTFT = the router's `ttft_s`; cached share = the producers' "
    "cached ÷ prompt tokens; router CPU in µs per request (all router processes); prefills per producer "
    "over the measured windows.",
    "| scenario | row | req/s | TTFB p50 ms | TTFB p99 ms | router TTFT p50 ms | cached share "
    "| router CPU µs | prefills per producer | errors |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
)


def _rows(name: str, res: dict[str, Any]) -> list[str]:
    """One variant's rows that ran, then those not available and why."""
    lines = [_row(name, res["concurrency"], row, s) for row, s in res["targets"].items()]
    return lines + [f"| {name} (c={res['concurrency']}) | {row} | {why} |||||||| "
                    for row, why in res.get("unavailable", {}).items()]


def table(results: dict[str, Any]) -> list[str]:
    """The ``prefix_scarce`` section of ``results.md``: every row of every variant, then the targets."""
    return judged_section(results, NAMES, _HEAD, _rows, "prefix_scarce", targets)
