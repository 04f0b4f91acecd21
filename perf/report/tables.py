"""The sections of ``results.md``, one function each, in the order the report prints them.

Every function takes the pooled results (or the part of the document it shows) and returns its
lines, starting with the blank line that separates it from the previous section, or no lines at
all when its scenario did not run: ``report.markdown`` only concatenates them, so a partial run
(``--scenarios``) simply has fewer sections. The tables' columns are what readers and scripts
grep for (the CI smoke test does): a column is renamed here or nowhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Verdict = tuple[str, str, str, str]  # one judged target: (target, figure, threshold, verdict)


def fmt(value: Any, digits: int = 1) -> str:
    """A figure as the tables show it: thousands separators, ``—`` for a figure nobody measured."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def header(meta: dict[str, Any]) -> list[str]:
    """Title, host and run shape, and which peer and baseline ran (or why not)."""
    lines = [f"# Narwhal perf — {meta['started']}", ""]
    lines.append(
        f"host: {meta['cores']} cores, load {meta['loadavg_start']} at start; Python {meta['python']}; "
        f"narwhal {meta['git']}; workers={meta['workers']}; rounds={meta['rounds']} × {meta['duration_s']:g} s "
        f"per target, interleaved; fake engines: {meta['topology']}, "
        f"coalesce {'on' if meta['coalesce'] else 'off'}"
    )
    lines.append(
        f"peer: `{meta['peer']['command']}`"
        if meta["peer"].get("command")
        else f"peer: not run ({meta['peer'].get('error') or 'no --peer given'})"
    )
    base = meta.get("baseline") or {}
    if base.get("ref"):
        lines.append(
            f"baseline: `{base['ref']}` = {base['commit'][:12]}" if base.get("commit") and not base.get("error")
            else f"baseline: `{base['ref']}` not run ({base.get('error')})"
        )
    return lines


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, PASS/FAIL, as ``report.evaluate_targets`` judged them."""
    return section(
        "Targets",
        "`PD floor` = `direct-pd`: the load generator runs the prefill leg and then the decode itself — what a "
        "router costing nothing would reach on this fleet.\n\n"
        "`on this host`: the same promise scaled to this machine by the peer's own figures in this run "
        "(CPU and TTFB), and for paced decode against the PD floor instead of direct.",
        "| target | narwhal | threshold | peer | PD floor | result | on this host | result here |",
        "|---|---|---|---|---|---|---|---|",
        [_target_row(t) for t in targets],
    )


def _target_row(t: dict[str, Any]) -> str:
    return (
        f"| {t['target']} | {fmt(t['narwhal'], 3)} | {t['threshold']} | {fmt(t['peer'], 3)} "
        f"| {fmt(t['pd_floor'], 3)} | **{t['result']}** | {t.get('host_threshold', '')} "
        f"| **{t.get('host_result', 'n/a')}** |"
    )


def load_table(results: dict[str, Any]) -> list[str]:
    """Every target of every load scenario, one row each (always printed, even empty)."""
    lines = section(
        "Load scenarios",
        "TTFB = first byte of the first token event (of the body when not streaming); "
        "CPU figures are µs per completed request; `other CPU` is host CPU not spent by this suite "
        "(noise from the shared machine).",
        "| scenario | target | req/s | ×direct | tok/s | TTFB p50 ms | TTFB p99 ms | +TTFB p50 ms "
        "| lat p50 ms | lat p99 ms | errors | router CPU µs | engine CPU µs | client CPU µs | other CPU % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    )
    for name, res in results.items():
        if res["kind"] != "load":
            continue
        for target, s in res["targets"].items():
            vs = s.get("vs_direct", {})
            errors = str(s["errors"]["count"])
            if s["errors"]["count"]:
                errors += " " + ", ".join(f"{k}:{v}" for k, v in s["errors"]["by_status"].items())
            lines.append(
                f"| {name} (c={res['concurrency']}) | {target} | {fmt(s['rps'])} | {fmt(vs.get('rps_ratio'), 3)} "
                f"| {fmt(s['tokens_per_s'], 0)} | {fmt(s['ttfb_ms']['p50'], 2)} | {fmt(s['ttfb_ms']['p99'], 2)} "
                f"| {fmt(vs.get('ttfb_p50_added_ms'), 2)} | {fmt(s['latency_ms']['p50'], 2)} "
                f"| {fmt(s['latency_ms']['p99'], 2)} | {errors} | {fmt(s['router_cpu_us_per_req'], 0)} "
                f"| {fmt(s['engine_cpu_us_per_req'], 0)} | {fmt(s['client_cpu_us_per_req'], 0)} "
                f"| {fmt(s['other_cpu_pct'])} |"
            )
    return lines


def baseline_table(results: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """``--baseline``: this checkout against the baseline, per load scenario both ran in."""
    rows = [
        (name, res["targets"]["narwhal"], res["targets"]["baseline"])
        for name, res in results.items()
        if res["kind"] == "load" and "baseline" in res["targets"] and "narwhal" in res["targets"]
    ]
    if not rows:
        return []
    return section(
        f"This checkout against the baseline ({base.get('ref')} = {(base.get('commit') or '')[:12]})",
        "Ratios are medians of per-round ratios (the two ran back to back in every round); below 1 "
        "means this checkout uses less CPU, above 1 that it serves more requests.",
        "| scenario | router CPU µs | baseline µs | CPU ratio | req/s ratio | TTFB p50 ms | baseline ms "
        "| per-round CPU ratios |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        [_baseline_row(name, mine, theirs) for name, mine, theirs in rows],
    )


def _baseline_row(name: str, mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    vs = mine.get("vs_baseline", {})
    return (
        f"| {name} | {fmt(mine['router_cpu_us_per_req'], 0)} | {fmt(theirs['router_cpu_us_per_req'], 0)} "
        f"| {fmt(vs.get('cpu_ratio'), 3)} | {fmt(vs.get('rps_ratio'), 3)} | {fmt(mine['ttfb_ms']['p50'], 2)} "
        f"| {fmt(theirs['ttfb_ms']['p50'], 2)} | {', '.join(f'{x:.3f}' for x in vs.get('cpu_ratio_rounds', []))} |"
    )


def cpu_by_process_table(results: dict[str, Any]) -> list[str]:
    """Narwhal's router CPU split into workers, master and the rest (the supervisor)."""
    breakdown = [
        (name, target, s["router_cpu_by_process_us_per_req"], s["router_cpu_us_per_req"])
        for name, res in results.items()
        if res["kind"] == "load"
        for target, s in res["targets"].items()
        if s.get("kind") == "narwhal" and s.get("router_cpu_by_process_us_per_req")
    ]
    if not breakdown:
        return []
    lines = [
        "",
        "Router CPU by process, µs per request (`other` = the supervisor, whose "
        "idle polling is charged to the requests of the window too):",
        "",
        "| scenario | target | workers | master | other | total |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, target, roles, total in breakdown:
        lines.append(
            f"| {name} | {target} | {fmt(roles.get('workers'), 0)} | {fmt(roles.get('master'), 0)} "
            f"| {fmt(roles.get('other'), 0)} | {fmt(total, 0)} |"
        )
    return lines


def profiles(results: dict[str, Any]) -> list[str]:
    """``--profile``: py-spy's top functions, one section per profiled scenario."""
    lines: list[str] = []
    for name, res in results.items():
        prof = res.get("profile")
        if not prof:
            continue
        lines += ["", f"## Profile: {name}, {prof.get('target', 'narwhal')} workers (py-spy, one extra round)", ""]
        if prof.get("error") or not prof.get("samples"):
            lines.append(f"no profile: {prof.get('error') or 'no samples'}")
            continue
        lines += [
            f"{prof['samples']} samples; files: {', '.join(prof.get('files', []))}",
            "",
            "| inclusive % | function | self % | function |",
            "|---:|---|---:|---|",
        ]
        for inc, own in zip(prof["inclusive"], prof["self"], strict=False):
            lines.append(f"| {inc['pct']} | `{inc['function']}` | {own['pct']} | `{own['function']}` |")
    return lines


def _per_target(run: dict[str, Any] | None, title: str, header: str, rule: str,
                row: Callable[[str, dict[str, Any]], str]) -> list[str]:
    """The section of one run over several targets (the worker sweep, memory): titled with the run's
    own title, one row per target; no lines when it did not run."""
    if not run:
        return []
    return section(f"{title} ({run['title']})", None, header, rule, [row(t, s) for t, s in run["targets"].items()])


def _sweep_row(target: str, s: dict[str, Any]) -> str:
    label = "direct" if target == "direct" else target.removeprefix("narwhal-w")
    return (
        f"| {label} | {fmt(s['rps'])} | {fmt(s.get('vs_direct', {}).get('rps_ratio'), 3)} "
        f"| {fmt(s['ttfb_ms']['p50'], 2)} | {fmt(s['ttfb_ms']['p99'], 2)} "
        f"| {fmt(s['router_cpu_us_per_req'], 0)} | {s['errors']['count']} |"
    )


def worker_sweep(results: dict[str, Any]) -> list[str]:
    """The worker sweep and the ``server.workers`` it recommends for this host."""
    sweep = results.get("workers")
    lines = _per_target(
        sweep, "Worker sweep",
        "| workers | req/s | ×direct | TTFB p50 ms | TTFB p99 ms | router CPU µs | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        _sweep_row,
    )
    if sweep:
        lines += [
            "",
            f"**Recommended `server.workers` for this host: {sweep.get('recommended_workers')}** "
            "(the smallest worker count within 5% of the best throughput)",
        ]
    return lines


def _memory_row(target: str, m: dict[str, Any]) -> str:
    return (
        f"| {target} | {m['open_at_peak']}/{m['streams']} | {m['errors']['count']} "
        f"| {m['idle']['rss_kib'] / 1024:.1f} | {m['peak']['rss_kib'] / 1024:.1f} "
        f"| {fmt(m['rss_growth_kib_per_stream'])} | {m['idle']['pss_kib'] / 1024:.1f} "
        f"| {m['peak']['pss_kib'] / 1024:.1f} | {fmt(m['pss_growth_kib_per_stream'])} "
        f"| {m['after']['rss_kib'] / 1024:.1f} | {fmt(m['ttfb_ms']['p99'], 1)} |"
    )


def memory_table(results: dict[str, Any]) -> list[str]:
    """RSS and PSS idle, at the peak of open slow streams, per stream and after."""
    return _per_target(
        results.get("memory"), "Memory",
        "| target | open at peak | errors | idle RSS MiB | peak RSS MiB | RSS KiB/stream "
        "| idle PSS MiB | peak PSS MiB | PSS KiB/stream | RSS after MiB | TTFB p99 ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        _memory_row,
    )


def closing(failed: dict[str, str], notes: list[str]) -> list[str]:
    """The scenarios that could not run, then the notes on what limited the figures."""
    lines: list[str] = []
    if failed:
        lines += ["", "## Scenarios that failed to run", ""] + [f"- {k}: {v}" for k, v in failed.items()]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return lines


def section(title: str, intro: str | None, header: str, rule: str, rows: Iterable[str] = ()) -> list[str]:
    """A ``results.md`` section: its title, what its figures mean (if they need it), its table's
    head, then whatever rows are already at hand (a caller may append more)."""
    return ["", f"## {title}", "", *((intro, "") if intro is not None else ()), header, rule, *rows]


def judged_section(results: dict[str, Any], names: tuple[str, ...], head: list[str],
                   rows: Callable[[str, dict[str, Any]], list[str]], what: str,
                   verdicts: Callable[[dict[str, Any]], list[Verdict]]) -> list[str]:
    """A section of named scenarios judged against their own targets (``perf/report/placement.py``,
    ``scarce.py``): its head, each scenario's rows, then the verdicts; no lines when none of them ran."""
    present = [n for n in names if n in results]
    if not present:
        return []
    lines = [*head, *(line for name in present for line in rows(name, results[name]))]
    lines += ["", f"| {what} target | figure | threshold | result |", "|---|---|---|---|"]
    return lines + [f"| {t} | {f} | {th} | {v} |" for t, f, th, v in verdicts(results)]
