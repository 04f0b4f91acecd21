"""Chaos suite: drive Narwhal through every docs/behaviour.md "Fake engines" fault and check every reply and every leak.

Why: unit and integration tests pin each failure mapping in isolation; production breaks in
combinations — a fault on one request while an engine is down, a breaker ejecting mid-burst, a
worker killed with streams open, a reload under load. This suite runs a real fake fleet
(2 producers, 2 consumers) and the router under gunicorn (2 workers), sends a seeded stream of
requests of which ~30 % carry a per-request fault, and meanwhile stops/starts engines, flaps
their health, fails their KV reads, kills a worker and the supervisor with SIGKILL and reloads
with SIGHUP. Every reply is checked against what the contract allows for the fault it met
(``perf.chaos.faults``); at the end, with faults cleared, every engine must be admitted again,
no reservation may be held, no KV handoff stranded, and router fds/RSS back near their start
(``perf.chaos.checks``). Then the poison storm (``perf.chaos.storm``): on a fresh fleet and
router, half the requests carry a fault every engine fails on, and clean requests must keep
succeeding. Then the dead consumer (``perf.chaos.dead_consumer``): one consumer ejected for
stream faults, the other killed, and clean requests still served. Exit status 1 on any violation
or leak, or a storm or the dead consumer below its bound.

Usage: ``python -m perf.chaos [--requests N] [--concurrency C] [--seed S] [--quick] [--out DIR]
[--poison-storm] [--max-ejected-fraction F ...] [--storm-s S] [--storm-concurrency C]``
(see ``perf/CHAOS.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

from perf.chaos import checks, dead_consumer, killed_consumer, soak, storm
from perf.chaos.driver import ENGINE_EVENTS, FAULT_FRACTION, MAX_FDS_GROWTH, MAX_RSS_GROWTH_KB, PROCESS_EVENTS, Chaos
from perf.chaos.faults import (
    ADMIN_TOKEN,
    CONSUMERS,
    PRODUCERS,
)
from perf.chaos.report import print_storm, print_summary, summarize


def run(args: argparse.Namespace) -> dict[str, Any]:
    chaos = Chaos(args)
    report: dict[str, Any] = {"args": vars(args)}
    try:
        chaos.start()
        assert chaos.router is not None and chaos.fleet is not None
        master = chaos.router.proc.pid
        # Warm up at full concurrency so pools and allocator arenas exist before the baseline.
        warm = asyncio.run(chaos.drive(max(2 * args.concurrency, 50), args.concurrency, tracks=False,
                                       faults=FAULT_FRACTION))
        report["warmup_violations"] = [r.problem for r in warm if r.verdict == "violation"][:5]
        time.sleep(1.0)
        base = checks.resources(master)
        chaos.done = 0
        t0 = time.monotonic()
        results = asyncio.run(chaos.drive(args.requests, args.concurrency, tracks=True, faults=FAULT_FRACTION))
        report["duration_s"] = round(time.monotonic() - t0, 1)
        report["windows"] = [{"kind": w.kind, "engine": w.engine, "start_s": round(w.start - t0, 3),
                              "end_s": round(w.end - t0, 3)} for w in chaos.windows]
        report["breaker_states"] = [[round(t - t0, 3), st] for t, st in chaos.states]
        for r in results:
            r.start, r.end = round(r.start - t0, 3), round(r.end - t0, 3)
        for name in PRODUCERS + CONSUMERS:  # clear every fault, restart every engine
            chaos.control("DELETE", f"/engines/{name}/faults")
            chaos.control("POST", f"/engines/{name}/start")
        windows = [(w.kind, w.engine, w.wall_start, w.wall_end) for w in chaos.windows]
        report.update(checks.final_checks(chaos.fleet, chaos.router.url, ADMIN_TOKEN, master, base, windows,
                                          PRODUCERS, CONSUMERS, (MAX_FDS_GROWTH, MAX_RSS_GROWTH_KB)))
        # Service is back: with every fault cleared and every engine admitted, clean requests
        # all succeed (a breaker stuck open or a worker that lost its view would show here).
        after = asyncio.run(chaos.drive(40, 4, tracks=False, faults=0.0))
        bad = [f"#{r.idx} {r.outcome} {r.problem}" for r in after if r.outcome != "ok"]
        if bad:
            report["leaks"].append(f"{len(bad)} of {len(after)} clean requests failed after recovery: {bad[:3]}")
        report["breaker_schedule_problems"] = chaos.breaker_schedule()
        report["leaks"] += report["breaker_schedule_problems"]
        report.update(summarize(results, chaos.windows, ENGINE_EVENTS + PROCESS_EVENTS))
        report["violations"] += len(report["warmup_violations"])
    finally:
        chaos.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=None, help="requests (default 2000, --quick 300)")
    p.add_argument("--concurrency", type=int, default=None, help="concurrent clients (default 64, --quick 16)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--strict", action="store_true",
                   help="count connection errors around a SIGHUP reload (a known finding) as violations")
    p.add_argument("--poison-storm", action="store_true", help="run only the poison storm (perf/chaos/storm.py)")
    p.add_argument("--max-ejected-fraction", type=float, nargs="+", default=[0.5], metavar="F",
                   help="the storm's recovery.max_ejected_fraction; several values: one storm each (default 0.5)")
    p.add_argument("--storm-s", type=float, default=None, help="storm seconds (default 20, --quick 8)")
    p.add_argument("--storm-concurrency", type=int, default=None, help="storm clients (default 64, --quick 32)")
    p.add_argument("--out", default=None, help="directory for chaos.json and the router logs")
    p.add_argument("--soak-minutes", type=float, default=None,
                   help="run only the soak for this long (perf/chaos/soak.py)")
    args = p.parse_args(argv)
    args.requests = args.requests or (300 if args.quick else 2000)
    args.concurrency = args.concurrency or (16 if args.quick else 64)
    args.storm_s = args.storm_s or (8.0 if args.quick else 20.0)
    args.storm_concurrency = args.storm_concurrency or (32 if args.quick else 64)
    args.out = args.out or tempfile.mkdtemp(prefix="narwhal-chaos-")
    os.makedirs(args.out, exist_ok=True)
    failed = False
    rep: dict[str, Any] = {"args": vars(args)}
    if args.soak_minutes:  # the fault mix for a long time: nothing may grow
        rep["soak"] = soak.run_soak(Chaos(args), args.soak_minutes, args.concurrency)
        soak.print_soak(rep["soak"])
        with open(os.path.join(args.out, "chaos.json"), "w") as f:
            json.dump(rep, f, indent=2, default=str)
        return 1 if rep["soak"]["failed"] else 0
    if not args.poison_storm:
        rep = run(args)
        failed = bool(rep["violations"] or rep["leaks"] or rep["request_faults_missing"]
                      or rep["engine_and_process_faults_missing"])
        print_summary(rep)
    rep["poison_storm"] = [
        storm.run_storm(Chaos(args), fraction, args.storm_s, args.storm_concurrency)
        for fraction in args.max_ejected_fraction
    ]
    for run_ in rep["poison_storm"]:
        print_storm(run_)
        failed = failed or bool(run_["failed"])
    if not args.poison_storm:  # a consumer ejected for faults, then the other one killed (docs/behaviour.md "Recovery")
        rep["dead_consumer"] = dead_consumer.run_dead_consumer(Chaos(args), 8.0 if args.quick else 20.0,
                                                               args.concurrency)
        dead_consumer.print_dead_consumer(rep["dead_consumer"])
        failed = failed or bool(rep["dead_consumer"]["failed"])
        # A consumer killed under slow streams: with migrations on, every stream it carried completes.
        rep["killed_consumer"] = killed_consumer.run_killed_consumer(Chaos(args), 6.0 if args.quick else 12.0,
                                                                     args.concurrency)
        killed_consumer.print_killed_consumer(rep["killed_consumer"])
        failed = failed or bool(rep["killed_consumer"]["failed"])
    with open(os.path.join(args.out, "chaos.json"), "w") as f:
        json.dump(rep, f, indent=2, default=str)
    print(f"  report: {os.path.join(args.out, 'chaos.json')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
