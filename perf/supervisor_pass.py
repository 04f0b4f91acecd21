"""The supervisor's loop alone (``Supervisor.run``: a pass every ``LOOP_S``) under uvloop, CPU ms/s.

Why: on an idle fleet the loop's fifty passes a second are most of the supervisor's cost, and
each is paid cold (the process slept 20 ms; on a shared VM its caches are someone else's by
then), so a pass costs several times what a tight loop of passes says. This runs the real loop
(``Supervisor.run``, its own session and prober) on a real shared region (and holdings region,
policy ``held``) with 2 worker slots claimed and N engines, nothing read from any engine
(``load_interval_s = 0``, no health round due), and reads the process's own CPU from
``/proc/self/task/*/schedstat`` over the window; then it counts the Python calls of a pass
(``cProfile``, passes back to back), a figure the host's load does not move. ``--baseline
REF[,REF…]`` runs each REF's ``narwhal/`` (exported, ``perf.baseline``) in a subprocess the same
way, interleaved with this checkout's; figures are medians over the rounds.

Usage: ``python -m perf.supervisor_pass [--engines 4,32] [--seconds 6] [--rounds 3] [--baseline REF]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import os
import statistics
import sys
import time
from typing import Any

from perf import baseline
from perf.load import procs

CALL_PASSES = 200


class _Prober:
    async def probe(self, *args: Any) -> tuple[str, str]:
        return "pass", ""

    async def health_failure(self, engine: Any) -> str | None:
        return None


async def _passes(engines: int, seconds: float) -> tuple[float, float]:
    """The supervisor's passes every LOOP_S for ``seconds``: this process's CPU ms per second; then
    Python calls per pass (``cProfile``, back to back): a figure the host's load does not move."""
    from narwhal.engines.control import PooledReader
    from narwhal.settings import Settings
    from narwhal.shm.shared import SharedFleet
    from narwhal.supervisor.load import LoadReader

    try:  # the policy's region and the supervisor's edge by their names since 9107e2d
        from narwhal.master.gunicorn_hooks import create_policy_region as region_of
        from narwhal.supervisor.edge import Supervisor
    except ImportError:  # a baseline before them
        from narwhal.supervisor.main import Supervisor  # type: ignore

        from narwhal.master.gunicorn_hooks import create_holdings as region_of  # type: ignore

    try:  # the loop's own module; a baseline before it ran the passes on the Supervisor
        from narwhal.supervisor.loop import Loop, run
    except ImportError:
        Loop = None  # type: ignore[assignment, misc]  # noqa: N806

    half = engines // 2
    specs = [{"name": f"p{i}", "url": f"http://127.0.0.1:{10000 + i}", "role": "producer"} for i in range(half)]
    specs += [{"name": f"d{i}", "url": f"http://127.0.0.1:{20000 + i}", "role": "consumer"}
              for i in range(engines - half)]
    settings = Settings.model_validate({"engines": specs, "placement": {"load_interval_s": 0},
                                        "recovery": {"health_interval_s": 3600}, "server": {"max_engines": 64}})
    shared = SharedFleet.create(engines=64, slots=512)
    shared.assign_engines([(e.name, e.url) for e in settings.engines])
    shared.claim_slot(os.getpid())
    shared.claim_slot(1)  # a second worker (pid 1 lives), as with server.workers = 2
    supervisor = Supervisor(shared, settings, region_of(settings, shared.layout.slots))
    # The real loop, as the supervisor process runs it.
    running = asyncio.ensure_future(run(supervisor) if Loop is not None else supervisor.run())
    await asyncio.sleep(1.0)  # its start first: imports, the first publish, caches
    start, began = procs.self_cpu_ns(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu = (procs.self_cpu_ns() - start) / 1e6 / (time.monotonic() - began)
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    loads = LoadReader(shared, PooledReader(settings.engine, 1.0))
    if Loop is not None:
        step = Loop.start(supervisor, _Prober(), loads).step  # type: ignore[arg-type]
    else:
        old = supervisor.start(_Prober(), loads)  # type: ignore[attr-defined]
        step = lambda: supervisor.step(old)  # type: ignore[attr-defined]  # noqa: E731
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALL_PASSES):
        step()
    profile.disable()
    calls = sum(entry.callcount for entry in profile.getstats())
    return cpu, calls / CALL_PASSES


def _measure(root: str | None, engines: int, seconds: float) -> tuple[float, float]:
    """One window in a fresh process: this checkout's ``narwhal`` or the tree at ``root``."""
    return baseline.child_figures("perf.supervisor_pass", root, [str(engines), str(seconds)], seconds + 120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.supervisor_pass", description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="4,32", help="fleet sizes, comma-separated (default 4,32)")
    parser.add_argument("--seconds", type=float, default=6.0, help="each window's length (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--baseline", help="git commits to measure beside this checkout, comma-separated")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import uvloop

        print(*uvloop.run(_passes(int(args.child[0]), float(args.child[1]))))
        return 0
    targets = baseline.targets_or_exit(args.baseline, "perf.supervisor_pass")
    print("| engines | target | loop CPU (ms/s), median | rounds | Python calls per pass |\n|---:|---|---:|---|---:|")
    for engines in [int(n) for n in args.engines.split(",") if n.strip()]:
        figures = baseline.interleaved(targets, args.rounds,
                                       functools.partial(_measure, engines=engines, seconds=args.seconds))
        for name, values in figures.items():
            cpu = [v[0] for v in values]
            print(f"| {engines} | {name} | {statistics.median(cpu):.2f} | {', '.join(f'{v:.2f}' for v in cpu)} "
                  f"| {statistics.median(v[1] for v in values):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
