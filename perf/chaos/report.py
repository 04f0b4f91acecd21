"""Summary of a chaos run: outcome counts, latency percentiles, the printed table.

Why separate: ``perf.chaos.run`` orchestrates processes and faults; turning results into the JSON
report and the terminal table is plain data work, kept apart so both stay short and readable.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from perf.chaos.faults import KINDS


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(results: list[Any], windows: list[Any], engine_kinds: list[str]) -> dict[str, Any]:
    outcomes = Counter(r.outcome if r.verdict != "violation" else "violation" for r in results)
    lat = [r.end - r.start for r in results]
    exercised = Counter(r.kind.split("@")[0] for r in results)
    kinds = Counter(w.kind for w in windows)
    return {
        "requests": len(results),
        "outcomes": dict(sorted(outcomes.items())),
        "latency_s": {"p50": round(percentile(lat, 0.5), 4), "p99": round(percentile(lat, 0.99), 4),
                      "max": round(max(lat, default=0.0), 4)},
        "violations": sum(r.verdict == "violation" for r in results),
        "findings": {"conn_error_reload": sum(r.outcome == "conn_error_reload" for r in results)},
        "violation_samples": [vars(r) for r in results if r.verdict == "violation"][:20],
        "timeline": [[r.idx, r.kind, r.outcome, r.start, r.end] for r in sorted(results, key=lambda r: r.start)],
        "request_faults_exercised": dict(sorted(exercised.items())),
        "request_faults_missing": sorted(set(KINDS) - set(exercised)),
        "engine_and_process_faults": dict(sorted(kinds.items())),
        "engine_and_process_faults_missing": sorted(set(engine_kinds) - set(kinds)),
    }


def print_summary(rep: dict[str, Any]) -> None:
    print(f"chaos: {rep.get('requests', 0)} requests in {rep.get('duration_s', '?')} s")
    print(f"  {'outcome':<44}{'count':>7}")
    for k, v in rep.get("outcomes", {}).items():
        print(f"  {k:<44}{v:>7}")
    lat = rep.get("latency_s", {})
    print(f"  latency p50 {lat.get('p50')} s  p99 {lat.get('p99')} s  max {lat.get('max')} s")
    print(f"  engine/process faults: {rep.get('engine_and_process_faults')}")
    kv = rep.get("kv", {})
    print(f"  KV: unread handoffs {kv.get('unread_handoffs')}, excused {kv.get('excused')}, "
          f"leaked {kv.get('leaked_handoffs')}, held blocks {kv.get('held_blocks')}")
    for role in ("master", "worker", "supervisor"):
        a, b = rep.get("resources_start", {}).get(role, []), rep.get("resources_end", {}).get(role, [])
        print(f"  {role:<10} fds {[p['fds'] for p in a]} -> {[p['fds'] for p in b]}   RSS MB "
              f"{[round(p['rss_kb'] / 1024, 1) for p in a]} -> {[round(p['rss_kb'] / 1024, 1) for p in b]}")
    print(f"  violations: {rep.get('violations')}   leaks: {len(rep.get('leaks', []))}")
    if rep.get("findings", {}).get("conn_error_reload"):
        print(f"  FINDING: {rep['findings']['conn_error_reload']} request(s) reset by a SIGHUP reload "
              "before any response (see perf/CHAOS.md; --strict fails on it)")
    for s in rep.get("violation_samples", [])[:10]:
        print(f"    VIOLATION #{s['idx']} {s['kind']}: {s['outcome']} {s['problem']}")
    for leak in rep.get("leaks", []):
        print(f"    LEAK {leak}")
    for k in ("request_faults_missing", "engine_and_process_faults_missing"):
        if rep.get(k):
            print(f"  not exercised ({k}): {rep[k]}")




def print_storm(rep: dict[str, Any]) -> None:
    """One poison-storm run (``perf.chaos.storm``): the figure first, then what explains it."""
    judged = "" if rep.get("enforced") else " (not judged: at 1.0 ejections may take a whole role)"
    print(f"poison storm, max_ejected_fraction {rep['max_ejected_fraction']}: {rep.get('requests', 0)} requests "
          f"in {rep.get('duration_s', '?')} s ({rep.get('req_per_s', '?')} req/s) at concurrency "
          f"{rep['concurrency']}, half poisoned")
    print(f"  clean_success_share {rep.get('clean_success_share')} ({rep.get('clean_ok')} of "
          f"{rep.get('clean')} clean requests){judged}")
    print(f"  clean failures {rep.get('clean_failures')}   poisoned {rep.get('poisoned_outcomes')}")
    for role in ("producer", "consumer"):
        shares = rep.get("roles", {}).get(role, {})
        print(f"  every {role} out {shares.get('all_out')} / out or quarantined "
              f"{shares.get('all_out_or_quarantined')} of the breaker samples")
    print(f"  violations: {rep.get('violations')}   leaks: {len(rep.get('leaks', []))}")
    for s in rep.get("violation_samples", [])[:5]:
        print(f"    VIOLATION #{s['idx']} {s['kind']}: {s['outcome']} {s['problem']}")
    for reason in rep.get("failed", []):
        print(f"    FAILED {reason}")
