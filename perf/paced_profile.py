"""``python -m perf.paced_profile``: where a paced stream's router CPU goes, per token.

Why: at production pace every token arrives on its own, so what a router pays per token is one
wakeup's share, one engine read, one client write and whatever runs between them. The timed
suite says how much (router CPU per request); this says where, for Narwhal and, with ``--peer``,
for vllm-router beside it, on the same fleet and load (``perf.load.stack``):

* user and system CPU per token of the router's whole process tree (``/proc/<pid>/stat``), and
  of the supervisor alone;
* with ``perf`` installed (Linux ``perf``, ``linux-tools``): the syscalls, context switches and
  wakeups per token (``perf stat``) and where the CPU goes by library and symbol, the kernel
  included (``perf record``; no call graphs: CPython 3.11 has no frame pointers);
* with py-spy installed: the Python functions of one worker (``perf.profile``).

Each section is skipped, with a line saying why, when its tool is missing. ``--baseline REF``
profiles REF's ``narwhal/`` instead of this checkout's (``perf.baseline``), to keep a before.

Usage: ``python -m perf.paced_profile [--tokens 128] [--delay 0.02] [--concurrency 128]
[--seconds 8] [--peer vllm-router] [--baseline REF] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perf import baseline
from perf import profile as pyprofile
from perf.load import procs
from perf.load.generator import COMPLETIONS, Workload, new_session, run_round
from perf.load.stack import Stack, Target

_TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")
_STAT_EVENTS = ("task-clock,context-switches,raw_syscalls:sys_enter,syscalls:sys_enter_epoll_pwait,"
                "syscalls:sys_enter_epoll_wait,syscalls:sys_enter_read,syscalls:sys_enter_write,"
                "syscalls:sys_enter_recvfrom,syscalls:sys_enter_writev,syscalls:sys_enter_futex")


def _cpu(pids: list[int]) -> tuple[int, int]:
    """User and system clock ticks of ``pids`` (exited ones count 0)."""
    user = system = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user, system = user + int(fields[11]), system + int(fields[12])
    return user, system


def _perf_tool(args: list[str], seconds: float) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("perf")
    if exe is None:
        return None
    return subprocess.Popen([exe, *args, "--", "sleep", str(seconds)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _stat_lines(path: Path) -> list[str]:
    """``perf stat``'s counts, one line each: ``count name``."""
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].replace(",", "").replace(".", "").isdigit():
            out.append(f"{parts[0]:>14} {parts[1]}")
    return out


def _report(data: Path, sort: str, top: int) -> list[str]:
    """``perf report``'s self-time table by ``sort`` (``dso`` or ``dso,sym``), its top rows."""
    exe = shutil.which("perf")
    assert exe is not None
    done = subprocess.run([exe, "report", "-i", str(data), "--no-children", "--sort", sort, "--stdio", "-g", "none"],
                          capture_output=True, text=True, timeout=120)
    rows = [line.rstrip()[:140] for line in done.stdout.splitlines() if line.strip() and not line.startswith("#")]
    return rows[:top]


async def _profile(stack: Stack, target: Target, work: Workload, args: argparse.Namespace, out_dir: Path) -> list[str]:
    """One target under the load, profiled over ``args.seconds`` once it runs steadily."""
    session = new_session()
    lines = [f"## {target.name}", ""]
    warmup = max(3.0, work.paced_s() + 0.5)
    load = asyncio.ensure_future(run_round(session, target.name, target.url, work, args.concurrency,
                                           args.seconds * 3 + 2, warmup, stack.groups()))
    try:
        await asyncio.sleep(warmup + 1)
        tree = procs.tree(target.pids)
        workers = [p for p in tree if procs.role(p) == "workers"] or tree
        others = [p for p in tree if procs.role(p) == "other"] if target.kind == "narwhal" else []
        pids = ",".join(map(str, workers))
        stat, data = out_dir / f"{target.name}.stat", out_dir / f"{target.name}.data"
        # Three windows, so no tool's own cost lands in another's figures: CPU alone, perf stat, profilers.
        before, side, started = _cpu(tree), _cpu(others), time.perf_counter()
        await asyncio.sleep(args.seconds)
        after, side_after, window = _cpu(tree), _cpu(others), time.perf_counter() - started
        counter = _perf_tool(["stat", "-e", _STAT_EVENTS, "-o", str(stat), "-p", pids], args.seconds)
        if counter is not None:
            await asyncio.to_thread(counter.wait)
        recorder = _perf_tool(["record", "-F", "999", "-o", str(data), "-p", pids], args.seconds)
        spy = None
        if target.kind == "narwhal" and pyprofile.py_spy() is not None:
            spy = pyprofile.Profiler(target.pids, args.seconds, out_dir, target.name)
        if recorder is not None:
            await asyncio.to_thread(recorder.wait)
        spy_paths = await asyncio.to_thread(spy.wait) if spy is not None else []
    finally:
        result = await load
        await session.close()
    tokens = result.tokens / result.window_s * window if result.window_s else 0.0
    if not tokens:
        return [*lines, "no request completed: nothing to divide by", ""]
    lines += [f"requests/s {result.requests / result.window_s:.1f}, tokens in the window {tokens:,.0f}, "
              f"errors {dict(result.errors) or 0}", "",
              "CPU per token, µs (whole process tree; the supervisor's share of it):",
              f"  user {(after[0] - before[0]) * _TICK_US / tokens:6.1f}"
              f"   system {(after[1] - before[1]) * _TICK_US / tokens:6.1f}"]
    if others:
        lines.append(f"  supervisor user+system {(sum(side_after) - sum(side)) * _TICK_US / tokens:6.1f}")
    lines.append("")
    if stat.exists():
        lines += [f"perf stat (the workers, the next {args.seconds:g} s; divide by the tokens above):",
                  *[f"  {x}" for x in _stat_lines(stat)], ""]
    else:
        lines += ["perf stat: not run (no `perf` on PATH)", ""]
    if data.exists():
        lines += ["perf record, self time by library:", *[f"  {x}" for x in _report(data, "dso", 10)], "",
                  "perf record, self time by symbol:", *[f"  {x}" for x in _report(data, "dso,sym", args.top)], ""]
    if spy_paths:
        summary = pyprofile.summarize(spy_paths, top=args.top)
        lines += [f"py-spy (one worker, {summary['samples']} samples, idle included), inclusive:",
                  *[f"  {r['pct']:5.1f}% {r['function']}" for r in summary["inclusive"]], ""]
    return lines


async def _run(args: argparse.Namespace, out_dir: Path) -> list[str]:
    work = Workload(COMPLETIONS, stream=True, tokens=args.tokens, fault={"decode": {"token_delay_s": args.delay}})
    stack = Stack(out_dir, workers=args.workers)
    lines = [f"# Paced streams: {args.tokens} tokens {args.delay * 1000:g} ms apart, c={args.concurrency}, "
             f"{args.workers} workers, {args.seconds:g} s per section", ""]
    try:
        stack.start_fleets()
        root = None
        if args.baseline:
            commit = baseline.export(args.baseline, baseline.REPO, out_dir / "baseline")
            root = str(out_dir / "baseline")
            lines += [f"narwhal: {args.baseline} ({commit[:12]})", ""]
        targets = [stack.narwhal("narwhal", root=root)]
        if args.peer:
            peer = stack.start_peer(args.peer)  # "vllm-router": the reference (perf.load.stack)
            if peer is None:
                lines += [f"peer not run: {stack.peer_error}", ""]
            else:
                targets.append(peer)
        for target in targets:
            lines += await _profile(stack, target, work, args, out_dir)
    finally:
        stack.close()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.paced_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between tokens (default 0.02)")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=8.0, help="each measurement's window (default 8)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="rows of each symbol and function table")
    parser.add_argument("--peer", default="", help="'vllm-router' (the reference) or a --peer command")
    parser.add_argument("--baseline", default="", help="profile this commit's narwhal/ instead of the checkout's")
    parser.add_argument("--out", default="", help="also write the report here")
    args = parser.parse_args(argv)
    out_dir = Path(tempfile.mkdtemp(prefix="narwhal-paced-profile-"))
    try:
        lines = asyncio.run(_run(args, out_dir))
    except baseline.BaselineError as exc:
        print(f"perf.paced_profile: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
