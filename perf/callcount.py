"""``python -m perf.callcount --baseline REF``: Python function calls per request, this checkout vs REF.

Why: on a shared 2-core host the CPU-per-request figures of ``python -m perf`` move by ±10 %
from run to run (other processes, frequency, cache), so a 3 % question cannot be answered
by them; hardware instruction counters are not available in a VM. The number of Python
function calls the router's processes make per request barely depends on the host's load
(only on how reads coalesce), and in this code base CPU follows it closely: what the
per-request path costs is interpreted calls. It is a proxy, reported as one, beside the timed
suite rather than instead of it.

How: the router's worker (the per-request path; the supervisor's work is per unit of time, and
it leaves through ``os._exit``, so it is not counted) runs under ``cProfile`` from its fork to
its exit (a ``sitecustomize`` on ``PYTHONPATH``,
written here; the router's code is untouched). Two runs per target, with a small and a large
request count, and the difference divided by the difference of counts: start-up and shutdown
cancel out. Targets are this checkout and REF's ``narwhal/`` (exported as ``--baseline`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf import baseline
from perf.load.generator import PROMPT, system_text
from perf.load.scenarios import LONG_SYSTEM_CHARS

MODEL = "callcount-model"
_SITECUSTOMIZE = '''
import os
_DIR = os.environ.get("PERF_CALLCOUNT_DIR")
if _DIR:
    import atexit, cProfile, time

    def _role():
        with open("/proc/self/cmdline", "rb") as f:  # the process title, set after the fork
            return "supervisor" if b"supervisor" in f.read() else "worker"

    def _profile_this_child():
        prof = cProfile.Profile()
        prof.enable()

        def dump():
            prof.disable()
            prof.dump_stats(f"{_DIR}/{_role()}-{os.getpid()}.prof")

        atexit.register(dump)

    def _time_this_child():  # --cpu: no profiler, only the CPU time the process used
        def dump():
            with open(f"{_DIR}/{_role()}-{os.getpid()}.cpu", "w") as f:
                f.write(repr(time.process_time()))

        atexit.register(dump)

    _CPU = os.environ.get("PERF_CALLCOUNT_CPU")
    os.register_at_fork(after_in_child=_time_this_child if _CPU else _profile_this_child)
'''


class Case(NamedTuple):
    """One request shape: streamed completions, or (``system_chars`` not None) streamed chats."""

    name: str
    concurrency: int
    token_delay_s: float | None = None
    system_chars: int | None = None  # chat: a system prompt this long (0: none) before the user's message
    tokens: int = 16


# The three shapes the house's refactors kept level (the default), and the chat pair:
# what a 4,000-character system prompt costs over a short chat (perf's chat_c32 and chat_long).
CASES = (Case("stream_c1", 1), Case("stream_c32", 32), Case("paced_c64", 64, 0.01),
         Case("chat_c32", 32, system_chars=0), Case("chat_long", 32, system_chars=LONG_SYSTEM_CHARS),
         Case("paced_long_c128", 128, 0.02, tokens=128))
DEFAULT_CASES = "stream_c1,stream_c32,paced_c64"


def _body(case: Case) -> tuple[str, bytes]:
    """The path and the bytes every request of ``case`` sends."""
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": case.tokens}
    if case.system_chars is None:
        path, body["prompt"] = "/v1/completions", "hello " * 20
    else:
        system = [{"role": "system", "content": system_text(case.system_chars)}] if case.system_chars else []
        path, body["messages"] = "/v1/chat/completions", [*system, {"role": "user", "content": PROMPT}]
    if case.token_delay_s is not None:
        body["narwhal_fake"] = {"decode": {"token_delay_s": case.token_delay_s}}
    return path, orjson.dumps(body)


async def _load(url: str, count: int, case: Case) -> None:
    path, data = _body(case)
    concurrency = case.concurrency
    left = [count]
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with session.post(url + path, data=data,
                                        headers={"Content-Type": "application/json"}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"router answered {resp.status}: {await resp.text()}")
                    await resp.read()

        await asyncio.gather(*(client() for _ in range(concurrency)))


FuncKey = tuple[str, int, str]  # (file, line, function), as pstats keys them


def _serve(run: Path, fleet: FakeFleet, root: str | None, count: int, case: Case, *,
           cpu: bool = False, workers: int = 1) -> Path:
    """One router run of ``count`` requests; the directory its processes wrote their figures to
    as they exited (``.prof`` profiles, or with ``cpu`` their CPU seconds in ``.cpu`` files)."""
    out = Path(tempfile.mkdtemp(prefix="calls-", dir=run))
    engines = [{"name": "p0", "role": "producer", "url": fleet.engines["p0"]},
               {"name": "d0", "role": "consumer", "url": fleet.engines["d0"]}]
    sections: dict[str, dict[str, Any]] = {"server": {"workers": workers}, "preflight": {"on_start": False},
                                           "log": {"access_log": "", "level": "warning"}}
    env = {"PERF_CALLCOUNT_DIR": str(out), "PYTHONPATH": str(run / "hook")}
    if cpu:
        env["PERF_CALLCOUNT_CPU"] = "1"
    router = RouterProcess.start(write_config(engines, sections), env=env, root=root, workers=workers,
                                 log_path=str(out / "router.log"))
    try:
        asyncio.run(_load(router.url, count, case))
    finally:
        router.stop()
    deadline = time.monotonic() + 10  # written as the processes exit: every worker and the supervisor
    while time.monotonic() < deadline and len(glob.glob(f"{out}/*.{'cpu' if cpu else 'prof'}")) < workers + 1:
        time.sleep(0.05)
    return out


def _calls(run: Path, fleet: FakeFleet, root: str | None, count: int, case: Case) -> dict[FuncKey, int]:
    """Calls per function of the router's worker over one run of ``count`` requests."""
    out = _serve(run, fleet, root, count, case)
    calls: dict[FuncKey, int] = {}
    for path in glob.glob(f"{out}/worker-*.prof"):
        stats = pstats.Stats(path).stats  # type: ignore[attr-defined]  # set at load; typeshed lacks it
        for func, (_, ncalls, *_rest) in stats.items():
            calls[func] = calls.get(func, 0) + ncalls
    return calls


def cpu_per_request(run: Path, fleet: FakeFleet, root: str | None, case: Case, small: int, large: int,
                    workers: int) -> float:
    """The workers' CPU µs per request, no profiler: the difference of two runs, as for calls."""

    def worker_cpu_s(count: int) -> float:
        out = _serve(run, fleet, root, count, case, cpu=True, workers=workers)
        return sum(float(Path(path).read_text()) for path in glob.glob(f"{out}/worker-*.cpu"))

    few = worker_cpu_s(small)
    return (worker_cpu_s(large) - few) / (large - small) * 1e6


def per_function(run: Path, fleet: FakeFleet, root: str | None, case: Case,
                 small: int, large: int) -> dict[FuncKey, float]:
    """Calls per request of each function: the difference of two runs, so start-up cancels out."""
    few, many = _calls(run, fleet, root, small, case), _calls(run, fleet, root, large, case)
    return {f: (n - few.get(f, 0)) / (large - small) for f, n in many.items()}


def per_request(run: Path, fleet: FakeFleet, root: str | None, case: Case,
                small: int, large: int) -> float:
    return sum(per_function(run, fleet, root, case, small, large).values())


def print_top(calls: dict[FuncKey, float], top: int, case: Case) -> None:
    """The functions that make the most calls per request, where a cut would pay."""
    print(f"\ntop {top} functions by calls per request (this checkout, {case.name}):")
    for (file, line, name), n in sorted(calls.items(), key=lambda kv: -kv[1])[:top]:
        where = file.split("site-packages/")[-1].split("/narwhal/")[-1]
        print(f"  {n:7.1f}  {name}  ({where}:{line})")


def print_changed(ours: dict[FuncKey, float], theirs: dict[FuncKey, float], top: int, case: Case) -> None:
    """The functions whose calls per request changed most against the baseline: where a
    difference in the totals comes from. Functions are matched by file and name (lines move)."""

    def by_name(calls: dict[FuncKey, float]) -> dict[tuple[str, str], float]:
        named: dict[tuple[str, str], float] = {}
        for (file, _line, name), n in calls.items():
            name = re.sub(r" at 0x[0-9a-f]+", "", name)  # a built-in's address differs per process
            where = (file.split("site-packages/")[-1].split("/narwhal/")[-1], name)
            named[where] = named.get(where, 0.0) + n
        return named

    mine, base = by_name(ours), by_name(theirs)
    change = {f: mine.get(f, 0.0) - base.get(f, 0.0) for f in mine.keys() | base.keys()}
    print(f"\ntop {top} changes in calls per request (this checkout - baseline, {case.name}):")
    for (where, name), n in sorted(change.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(f"  {n:+7.1f}  {name}  ({where})")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perf.callcount", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git commit to compare with (e.g. main~3)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per measurement (default 400; with --cpu 2,000)")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per target (default 2)")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also list this checkout's N functions with the most calls per request (the last case)")
    parser.add_argument("--changed", type=int, default=0, metavar="N",
                        help="also list the N functions whose calls per request changed most (the last case)")
    parser.add_argument("--cpu", action="store_true",
                        help="instead of calls, the workers' CPU µs per request with no profiler attached: "
                             "timed, so noisy, but of the code as it runs (take 8-10 rounds)")
    parser.add_argument("--workers", type=int, default=1, help="the router's workers (default 1)")
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help=f"comma-separated, of {', '.join(c.name for c in CASES)} (default {DEFAULT_CASES})")
    return parser


def compare(run: Path, fleet: FakeFleet, case: Case, args: argparse.Namespace) -> None:
    """One row: ``case``'s figure per request for this checkout and the baseline, interleaved and
    in alternating order, as the timed suite does, so a drift in the host hits both alike."""
    figures: dict[str, list[float]] = {"head": [], "base": []}
    for r in range(args.rounds):
        targets = (("head", None), ("base", str(run / "base")))
        for name, root in targets if r % 2 == 0 else targets[::-1]:
            if args.cpu:
                figure = cpu_per_request(run, fleet, root, case, 100, 100 + args.requests, args.workers)
            else:
                figure = per_request(run, fleet, root, case, 50, 50 + args.requests)
            figures[name].append(figure)
    ours, theirs = statistics.median(figures["head"]), statistics.median(figures["base"])
    ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(figures["head"], figures["base"], strict=True))
    print(f"| {case.name} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.3f} | {ratios} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 2000 if args.cpu else 400
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in args.cases.split(",") if n not in by_name]
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)}")
    cases = [by_name[n] for n in args.cases.split(",")]
    repo = Path(__file__).resolve().parent.parent
    run = Path(tempfile.mkdtemp(prefix="narwhal-callcount-"))
    (run / "hook").mkdir()
    (run / "hook" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    try:
        commit = baseline.export(args.baseline, repo, run / "base")
    except baseline.BaselineError as exc:
        print(f"perf.callcount: {exc}", file=sys.stderr)
        return 2
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    what = "worker CPU µs" if args.cpu else "function calls"
    print(f"{what} per request: this checkout ({head.stdout.strip()}) vs {args.baseline} ({commit[:12]}), "
          f"{args.workers} worker(s)")
    print("| case | this checkout | baseline | ratio | per-round ratios |\n|---|---:|---:|---:|---|")
    fleet = FakeFleet.start(["p0", "d0"], args=["--model", MODEL])
    try:
        for case in cases:
            compare(run, fleet, case, args)
        if args.top or args.changed:
            last = cases[-1]
            head_calls = per_function(run, fleet, None, last, 50, 50 + args.requests)
            if args.top:
                print_top(head_calls, args.top, last)
            if args.changed:
                base_calls = per_function(run, fleet, str(run / "base"), last, 50, 50 + args.requests)
                print_changed(head_calls, base_calls, args.changed, last)
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
