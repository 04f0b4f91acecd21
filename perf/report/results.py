"""Turn the results into the report: the issue's targets judged, JSON (every figure) and Markdown.

Targets are evaluated here, not in the scenarios, so a partial run (``--scenarios``) still gets
a table: a target whose scenario did not run says "n/a". The report never fails a run: it only
says PASS or FAIL, tuning the router is someone else's job. The Markdown's sections are in
``perf/report/tables.py``, the PNG plots in ``perf/report/plots.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perf.report import placement as placement_report
from perf.report import scarce as scarce_report
from perf.report import tables
from perf.report.figures import figure, verdict

# The thresholds.
CPU_US_C32 = 600.0
RATIO_C32_FALLBACK = 0.41
ADDED_TTFB_MS_C1 = 0.6
PACED_RATIO = 0.97
RSS_KIB_PER_STREAM = 100.0
# Router CPU per request against the peer's in the same run, and a long prompt's extra cost.
CPU_VS_PEER = 0.9
CPU_VS_PEER_SCENARIOS = ("stream_c1", "stream_c32", "stream_c128", "paced_c128", "chat_long")
LONG_OVER_SHORT = 1.15
# What the reference peer (vllm-router 0.1.17) measured on the host the thresholds come from.
PEER_CPU_US_C32 = 290.0
PEER_ADDED_TTFB_MS_C1 = 0.57


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target of the issue: Narwhal's figure, the threshold, the peer's and the PD floor's.

    The PD floor is ``direct-pd``: the load generator doing prefill then decode itself, what a
    router that costs nothing would achieve on this fleet.
    """
    here = _host_thresholds(results)
    peer_ratio = figure(results, "stream_c32", "peer", "vs_direct", "rps_ratio")
    bar = peer_ratio if peer_ratio is not None else RATIO_C32_FALLBACK
    big = results.get("paced_c1000", {}).get("concurrency", 1000)
    return [
        _row(
            results,
            "router CPU per request, streaming c=32",
            "stream_c32",
            ("router_cpu_us_per_req",),
            f"≤ {CPU_US_C32:g} µs",
            lambda v: v <= CPU_US_C32,
            floor=False,
            here=here["cpu"],
        ),
        _row(
            results,
            "throughput ×direct, streaming c=32",
            "stream_c32",
            ("vs_direct", "rps_ratio"),
            f"≥ {bar:.3f} ({'peer' if peer_ratio is not None else 'no peer: fixed'})",
            lambda v: v >= bar,
        ),
        _row(
            results,
            "added TTFB p50 over direct, streaming c=1 (ms)",
            "stream_c1",
            ("vs_direct", "ttfb_p50_added_ms"),
            f"≤ {ADDED_TTFB_MS_C1:g} ms",
            lambda v: v <= ADDED_TTFB_MS_C1,
            here=here["ttfb"],
        ),
        _row(
            results,
            "paced decode 10 ms/token c=128, throughput ×direct",
            "paced_c128",
            ("vs_direct", "rps_ratio"),
            f"≥ {PACED_RATIO:g}",
            lambda v: v >= PACED_RATIO,
            here=here["paced"],
        ),
        _row(results, f"paced decode c={big}: errors", "paced_c1000", ("errors", "count"), "= 0", lambda v: v == 0),
        _memory_row(results),
        *(_cpu_vs_peer_row(results, name) for name in CPU_VS_PEER_SCENARIOS),
        _long_over_short_row(results),
    ]


def _ratio_row(name: str, value: float | None, threshold: str, ok: bool | None) -> dict[str, Any]:
    """A target that is a ratio of two figures of this run: the same threshold on any host."""
    value = None if value is None else round(value, 3)
    return {"target": name, "narwhal": value, "threshold": threshold, "peer": None, "pd_floor": None,
            "result": verdict(ok), "host_threshold": threshold, "host_result": verdict(ok)}


def _cpu_vs_peer_row(results: dict[str, Any], scenario: str) -> dict[str, Any]:
    """Narwhal's router CPU per request over the peer's, both measured in the same rounds."""
    mine = figure(results, scenario, "narwhal", "router_cpu_us_per_req")
    peer = figure(results, scenario, "peer", "router_cpu_us_per_req")
    ratio = mine / peer if mine is not None and peer else None
    return _ratio_row(f"router CPU per request ×peer, {scenario}", ratio, f"≤ {CPU_VS_PEER:g} (needs --peer)",
                      None if ratio is None else ratio <= CPU_VS_PEER)


def _long_over_short_row(results: dict[str, Any]) -> dict[str, Any]:
    """What a 4,000-character system prompt costs over a short chat at the same concurrency."""
    long = figure(results, "chat_long", "narwhal", "router_cpu_us_per_req")
    short = figure(results, "chat_c32", "narwhal", "router_cpu_us_per_req")
    ratio = long / short if long is not None and short else None
    return _ratio_row("router CPU per request, chat_long ×chat_c32", ratio, f"≤ {LONG_OVER_SHORT:g}",
                      None if ratio is None else ratio <= LONG_OVER_SHORT)


# A threshold as text and its test; the test is None when the figure it scales by is missing.
HostThreshold = tuple[str, Callable[[Any], bool] | None]


def _host_thresholds(results: dict[str, Any]) -> dict[str, HostThreshold]:
    """The same promises on *this* host, for the CPU, TTFB and paced targets.

    The thresholds come from a faster host where the peer used PEER_CPU_US_C32 per request;
    here they are scaled by what the peer used in this run, and the paced ratio is taken
    against the PD floor (a router costing nothing), which on a small host where engines and
    load share the cores is far below direct.
    """
    peer_cpu = figure(results, "stream_c32", "peer", "router_cpu_us_per_req")
    peer_ttfb = figure(results, "stream_c1", "peer", "vs_direct", "ttfb_p50_added_ms")
    floor_paced = figure(results, "paced_c128", "direct-pd", "vs_direct", "rps_ratio")
    cpu_here = None if peer_cpu is None else CPU_US_C32 * peer_cpu / PEER_CPU_US_C32
    ttfb_here = None if peer_ttfb is None else ADDED_TTFB_MS_C1 * peer_ttfb / PEER_ADDED_TTFB_MS_C1
    paced_here = None if floor_paced is None else PACED_RATIO * floor_paced
    missing: HostThreshold = ("", None)
    return {
        "cpu": (f"≤ {cpu_here:,.0f} µs (600 × peer {peer_cpu:,.0f} / 290)", lambda v: v <= cpu_here)
        if cpu_here is not None
        else missing,
        "ttfb": (f"≤ {ttfb_here:.3f} ms (0.6 × peer {peer_ttfb:.3f} / 0.57)", lambda v: v <= ttfb_here)
        if ttfb_here is not None
        else missing,
        "paced": (f"≥ {paced_here:.3f} (0.97 × PD floor)", lambda v: v >= paced_here)
        if paced_here is not None
        else missing,
    }


def _row(
    results: dict[str, Any],
    name: str,
    scenario: str,
    path: tuple[str, ...],
    threshold: str,
    test: Callable[[Any], bool],
    floor: bool = True,
    here: HostThreshold | None = None,
) -> dict[str, Any]:
    """One target judged against the issue's threshold and, with ``here``, against this host's."""
    value = figure(results, scenario, "narwhal", *path)
    host_threshold, host_test = here if here is not None else (threshold, test)
    return {
        "target": name,
        "narwhal": value,
        "threshold": threshold,
        "peer": figure(results, scenario, "peer", *path),
        "pd_floor": figure(results, scenario, "direct-pd", *path) if floor else None,
        "result": verdict(None if value is None else bool(test(value))),
        "host_threshold": host_threshold if host_test is not None else "n/a (needs --peer)",
        "host_result": verdict(None if value is None or host_test is None else bool(host_test(value))),
    }


def _memory_row(results: dict[str, Any]) -> dict[str, Any]:
    """The slow-streams target: two figures (errors and RSS growth) in one row, the same on any host."""
    mem, pmem = figure(results, "memory", "narwhal"), figure(results, "memory", "peer")

    def mem_text(m: dict[str, Any] | None) -> str | None:
        if m is None:
            return None
        return f"{tables.fmt(m.get('rss_growth_kib_per_stream'))} KiB, {m['errors']['count']} errors"

    ok = None
    if mem is not None:
        growth = mem.get("rss_growth_kib_per_stream")
        ok = mem["errors"]["count"] == 0 and growth is not None and growth < RSS_KIB_PER_STREAM
    return {
        "target": f"{mem['streams'] if mem else 1000} slow streams: no errors, router RSS growth per stream",
        "narwhal": mem_text(mem),
        "threshold": f"< {RSS_KIB_PER_STREAM:g} KiB, 0 errors",
        "peer": mem_text(pmem),
        "pd_floor": None,
        "result": verdict(ok),
        "host_threshold": f"< {RSS_KIB_PER_STREAM:g} KiB, 0 errors",
        "host_result": verdict(ok),
    }


def markdown(doc: dict[str, Any]) -> str:
    """``results.md``: the sections of ``perf/report/tables.py`` in order, those with nothing to show left out."""
    results = {k: v for k, v in doc["scenarios"].items() if "error" not in v}
    failed = {k: v["error"] for k, v in doc["scenarios"].items() if "error" in v}
    lines = tables.header(doc["meta"])
    lines += tables.targets_table(doc["targets"])
    lines += tables.load_table(results)
    lines += tables.baseline_table(results, doc["meta"].get("baseline") or {})
    lines += tables.cpu_by_process_table(results)
    lines += tables.profiles(results)
    lines += tables.worker_sweep(results)
    lines += tables.memory_table(results)
    lines += placement_report.table(results)
    lines += scarce_report.table(results)
    lines += tables.closing(failed, doc.get("notes") or [])
    return "\n".join(lines) + "\n"


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
