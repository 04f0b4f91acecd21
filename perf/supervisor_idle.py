"""The supervisor's own CPU, in ms per second, on an idle fleet and at c=1.

Why: the supervisor's work is per unit of time (a pass of its loop every 20 ms, ``/metrics`` of
every engine every ``placement.load_interval_s``), so it is paid whether requests come or not,
and at c=1 it is a visible share of the router's CPU per request (22 ms/s idle).

How: one fake-engine process hosting N engines (half producers, half consumers, every pair
permitted) and the router under real gunicorn with its defaults and 2 workers. After the start
has settled, the supervisor's CPU is read over an idle window, then over a window of one client
streaming 16-token completions back to back. CPU comes from ``/proc/<pid>/task/*/schedstat``
(nanoseconds on the CPU, every thread), so a 10 s window resolves well below 1 ms/s. With
``--baseline REF[,REF…]`` each REF's ``narwhal/`` runs as a target of its own in the same
interleaved rounds (``perf.baseline``; ``--no-checkout``: only those, so the files may change
while it runs); the figures are medians over the rounds. ``--profile DIR`` samples the first
target's supervisor with py-spy (``pip install py-spy``) over the idle window of the first
round and prints its hottest functions.

Usage: ``python -m perf.supervisor_idle [--engines 4,32] [--seconds 10] [--rounds 3]
[--workers 2] [--baseline REF[,REF…]] [--no-checkout] [--profile DIR] [--set SECTION.KEY=VALUE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles, write_config
from perf import baseline, profile
from perf.load import procs

MODEL = "fake-model"
SETTLE_S = 3.0  # after /ready: the first health round, the first reads' connections, preflight's tail


def on_cpu_ns(pid: int) -> int:
    """Nanoseconds every thread of ``pid`` has spent on a CPU (``schedstat``'s first field); 0 once gone."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class Window:
    """One measured window: the supervisor's CPU per second, the router's, requests per second."""

    supervisor_ms_s: float
    router_ms_s: float
    requests_s: float


def _supervisor(router: RouterProcess) -> int:
    found = router_roles(router.proc.pid)["supervisor"]
    if len(found) != 1:
        raise RuntimeError(f"expected one supervisor, found {found}")
    return found[0]


async def _stream_c1(url: str, seconds: float) -> int:
    """One client, 16-token streaming completions back to back for ``seconds``; how many were answered."""
    data = orjson.dumps({"model": MODEL, "prompt": "hello " * 20, "stream": True, "max_tokens": 16,
                         "stream_options": {"include_usage": True}})
    done = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            async with session.post(url + "/v1/completions", data=data,
                                    headers={"Content-Type": "application/json"}) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"router answered {resp.status}: {body[:200]!r}")
            done += 1
    return done


def measure(router: RouterProcess, seconds: float, load: bool) -> Window:
    """The supervisor's and the router's CPU over ``seconds``, idle or under one streaming client."""
    sup = _supervisor(router)
    cpu0, tree0, t0 = on_cpu_ns(sup), procs.cpu_seconds([router.proc.pid]), time.monotonic()
    if load:
        requests = asyncio.run(_stream_c1(router.url, seconds))
    else:
        time.sleep(seconds)
        requests = 0
    cpu1, tree1, t1 = on_cpu_ns(sup), procs.cpu_seconds([router.proc.pid]), time.monotonic()
    if _supervisor(router) != sup:
        raise RuntimeError("the supervisor was replaced during the window")
    elapsed = t1 - t0
    return Window((cpu1 - cpu0) / 1e6 / elapsed, (tree1 - tree0) * 1000 / elapsed, requests / elapsed)


def _config(fleet: FakeFleet, workers: int, tmp: Path, overrides: list[str]) -> str:
    names = list(fleet.engines)
    producers = len(names) // 2
    specs = [{"name": name, "url": fleet.engines[name], "role": "producer" if i < producers else "consumer"}
             for i, name in enumerate(names)]
    sections: dict[str, dict[str, Any]] = {"server": {"workers": workers, "max_engines": max(64, len(names))},
                                           "log": {"access_log": str(tmp / "access.log")}}
    for item in overrides:  # --set section.key=value, the value as TOML would read a number or word
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        value: Any = raw
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                continue
        if raw in ("true", "false"):
            value = raw == "true"
        sections.setdefault(section, {})[name] = value
    return write_config(specs, sections)


def _profile(router: RouterProcess, seconds: float, out: Path) -> None:
    """py-spy on the supervisor over one idle window; the hottest functions printed."""
    exe = profile.py_spy()
    if exe is None:
        print("--profile: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"supervisor-{_supervisor(router)}.txt"
    cmd = [exe, "record", "--nonblocking", "-r", str(profile.RATE_HZ), "-d", str(max(1, round(seconds))),
           "--format", "raw", "-o", str(path), "-p", str(_supervisor(router))]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=seconds + 30, check=False)
    summary = profile.summarize([path] if path.exists() else [], top=25)
    print(f"\nsupervisor profile, idle ({summary['samples']} samples at {profile.RATE_HZ} Hz, {path}):")
    for kind in ("self", "inclusive"):
        print(f"  {kind}:")
        for row in summary[kind]:
            print(f"    {row['pct']:5.1f} %  {row['function']}")


def run_target(fleet: FakeFleet, workers: int, seconds: float, root: str | None,
               profile_dir: Path | None, overrides: list[str]) -> tuple[Window, Window]:
    """One router start of a target: its idle window, then its c=1 window."""
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-sup-idle-"))
    config = _config(fleet, workers, tmp, overrides)
    router = RouterProcess.start(config, log_path=str(tmp / "router.log"), workers=workers, root=root, timeout=120)
    try:
        time.sleep(SETTLE_S)
        if profile_dir is not None:
            _profile(router, seconds, profile_dir)
        idle = measure(router, seconds, load=False)
        busy = measure(router, seconds, load=True)
    finally:
        router.stop()
    return idle, busy


def _median(windows: list[Window], field: str) -> float:
    return float(statistics.median(getattr(w, field) for w in windows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.supervisor_idle", description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="4,32", help="fleet sizes, comma-separated (default 4,32)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each window's length (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (default 2)")
    parser.add_argument("--baseline", help="git commits to measure beside this checkout, comma-separated (e.g. main)")
    parser.add_argument("--no-checkout", action="store_true",
                        help="measure only the --baseline commits (each exported), not this checkout's files")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="py-spy the first target's idle supervisor")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a setting for every target, e.g. placement.load_interval_s=0 (repeatable)")
    args = parser.parse_args(argv)
    targets = baseline.targets_or_exit(args.baseline, "perf.supervisor_idle", checkout=not args.no_checkout)
    if not targets:
        parser.error("nothing to measure: --no-checkout needs --baseline")
    rows: list[tuple[int, str, list[Window], list[Window]]] = []
    for engines in [int(n) for n in args.engines.split(",") if n.strip()]:
        names = [f"p{i}" for i in range(engines // 2)] + [f"d{i}" for i in range(engines - engines // 2)]
        fleet = FakeFleet.start(names, args=["--model", MODEL], timeout=60)
        results: dict[str, tuple[list[Window], list[Window]]] = {name: ([], []) for name, _ in targets}
        try:
            for rnd in range(args.rounds):
                for name, root in targets:  # interleaved: a drift of the host hits every target alike
                    want = args.profile if (rnd == 0 and name == targets[0][0]) else None
                    idle, busy = run_target(fleet, args.workers, args.seconds, root, want, args.set)
                    results[name][0].append(idle)
                    results[name][1].append(busy)
                    print(f"{engines} engines, {name}, round {rnd + 1}: supervisor idle {idle.supervisor_ms_s:.1f} "
                          f"ms/s, c=1 {busy.supervisor_ms_s:.1f} ms/s ({busy.requests_s:.0f} req/s; router "
                          f"{idle.router_ms_s:.0f} / {busy.router_ms_s:.0f} ms/s)", flush=True)
        finally:
            fleet.stop()
        rows += [(engines, name, idle, busy) for name, (idle, busy) in results.items()]
    print(f"\nmedians over {args.rounds} round(s) of {args.seconds:g} s")
    print("| engines | target | supervisor idle (ms/s) | supervisor c=1 (ms/s) | c=1 req/s | router idle (ms/s) "
          "| router c=1 (ms/s) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for engines, name, idles, busies in rows:
        print(f"| {engines} | {name} | {_median(idles, 'supervisor_ms_s'):.1f} "
              f"| {_median(busies, 'supervisor_ms_s'):.1f} | {_median(busies, 'requests_s'):.0f} "
              f"| {_median(idles, 'router_ms_s'):.0f} | {_median(busies, 'router_ms_s'):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
