"""``python -m perf``: start the stack, run the selected scenarios, write and print the report.

Why one long-lived event loop (``asyncio.Runner``) driven from synchronous code: the harness that
starts gunicorn and the fleets blocks (it polls with ``time.sleep``), so processes are started
between scenarios, outside the loop, while the loop itself — and with it uvloop — lives for the
whole run. Everything started is stopped in ``finally``, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from perf import baseline, procs, report, report_plots
from perf.memory import run_memory
from perf.notes import notes
from perf.scenarios import (
    Scenario,
    ScenarioResult,
    against_baseline,
    all_scenarios,
    compare,
    ensure_targets,
    recommend_workers,
    run_load,
    select,
    summarize,
)
from perf.stack import Stack, expand_peer

T = TypeVar("T")
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny durations and counts (the CI smoke run)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="measured seconds per target per round (default 2.0; --quick 0.5)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    p.add_argument("--scenarios", default=None, metavar="A,B", help="scenario names or prefixes (default: all)")
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="server.workers of the router outside the worker sweep (default 2)",
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help="write the results here (default perf/results/<timestamp>/)"
    )
    p.add_argument(
        "--peer",
        default=None,
        metavar="COMMAND",
        help="another router to compare, templated with {producer_url} {consumer_url} {port} "
        "{free_port}; 'vllm-router' is short for the vllm-router 0.1.17 PD command",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="REF",
        help="also run the narwhal/ package of git commit REF (e.g. HEAD, main~3) in the same "
        "interleaved rounds, and report this checkout against it",
    )
    p.add_argument(
        "--profile",
        nargs="?",
        const="stream_c32",
        default=None,
        metavar="SCENARIO",
        help="after SCENARIO's measured rounds (default stream_c32), profile Narwhal's workers with "
        "py-spy during one extra round (pip install py-spy)",
    )
    p.add_argument(
        "--fleet",
        choices=("split", "single"),
        default="split",
        help="split: producer and consumer fake engines in two processes (default); single: one process "
        "(in-process KV handoff, but one core at most)",
    )
    p.add_argument(
        "--coalesce",
        action="store_true",
        help="fake engines write a zero-delay stream in one write (not faithful; less engine CPU)",
    )
    args = p.parse_args(argv)
    if args.duration is not None and args.duration <= 0:
        p.error("--duration must be > 0")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def _git() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "narwhal"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return (rev or "unknown") + (" (narwhal/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _say(message: str) -> None:
    print(f"[perf] {message}", file=sys.stderr, flush=True)


class Interrupts:
    """SIGTERM and Ctrl-C stop the run cleanly, wherever it is.

    Raising from a signal handler while the event loop runs would land in whatever callback is
    running (uvloop reports it as a transport error and carries on), so inside the loop the
    handler only cancels the scenario's task, whose ``finally`` blocks stop its load; between
    scenarios (starting processes, sync code) it raises KeyboardInterrupt. Either way ``run``'s
    ``finally`` then stops every process.
    """

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.hit = False
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started in the background with SIGINT ignored: keep it so
            self._saved[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.hit = True
        if self.task is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    def run(self, runner: asyncio.Runner, coro: Coroutine[Any, Any, T]) -> T:
        async def guarded() -> T:
            self.task, self.loop = asyncio.current_task(), asyncio.get_running_loop()
            try:
                return await coro
            finally:
                self.task = self.loop = None

        try:
            return runner.run(guarded())
        except asyncio.CancelledError:
            if self.hit:
                raise KeyboardInterrupt("interrupted") from None
            raise


INTERRUPTS = Interrupts()


def run(args: argparse.Namespace) -> int:
    quick: bool = args.quick
    cores = os.cpu_count() or 1
    duration = args.duration if args.duration is not None else (0.5 if quick else 2.0)
    rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
    chosen: list[Scenario] = select(all_scenarios(quick, cores), args.scenarios)
    started = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) if args.out else RESULTS / started
    out_dir.mkdir(parents=True, exist_ok=True)
    nofile = procs.raise_nofile_limit()
    meta: dict[str, Any] = {
        "started": started,
        "quick": quick,
        "cores": cores,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": _git(),
        "workers": args.workers,
        "rounds": rounds,
        "duration_s": duration,
        "coalesce": args.coalesce,
        "nofile": list(nofile),
        "loadavg_start": [round(x, 2) for x in procs.loadavg()],
        "topology": "1 producer + 1 consumer fake engine, "
        + ("each in its own process" if args.fleet == "split" else "both in one process"),
        "fleet": args.fleet,
        "peer": {"command": None, "error": None},
        "baseline": {"ref": args.baseline, "commit": None, "error": None},
    }
    results: dict[str, Any] = {}
    failed: list[str] = []
    t_start = time.monotonic()
    stack = Stack(out_dir, workers=args.workers, coalesce=args.coalesce, fleet=args.fleet)
    INTERRUPTS.install()
    try:
        _say(f"results in {out_dir}; starting fake engines")
        stack.start_fleets()
        if args.peer:
            _say(f"starting peer: {expand_peer(args.peer)}")
            peer = stack.start_peer(args.peer)
            meta["peer"] = {"command": peer.detail["command"] if peer else None, "error": stack.peer_error}
            if peer is None:
                _say(f"peer not used: {stack.peer_error}")
        if args.baseline:
            try:
                meta["baseline"]["commit"] = baseline.export(args.baseline, REPO, out_dir / "baseline")
                stack.baseline_root = str((out_dir / "baseline").resolve())
                _say(f"baseline: {args.baseline} = {meta['baseline']['commit'][:12]}")
            except baseline.BaselineError as exc:
                meta["baseline"]["error"] = str(exc)
                _say(f"baseline not used: {exc}")
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:  # pragma: no cover - uvloop is a narwhal dependency
            loop_factory = None
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            for scenario in chosen:
                t0 = time.monotonic()
                try:
                    profile = out_dir if args.profile == scenario.name else None
                    results[scenario.name] = _run_one(runner, stack, scenario, rounds, duration, cores, quick, profile)
                except KeyboardInterrupt:
                    raise
                except Exception as exc:
                    failed.append(scenario.name)
                    results[scenario.name] = {
                        "name": scenario.name,
                        "kind": scenario.kind,
                        "title": scenario.title,
                        "concurrency": scenario.concurrency,
                        "error": f"{type(exc).__name__}: {exc}",
                        "targets": {},
                    }
                    _say(f"{scenario.name} FAILED: {exc}")
                    traceback.print_exc(file=sys.stderr)
                _say(f"{scenario.name} done in {time.monotonic() - t0:.1f}s")
                report.write_json({"meta": meta, "scenarios": results, "partial": True}, out_dir / "results.json")
    finally:
        _say("stopping processes")
        stack.close()
        INTERRUPTS.restore()

    if stack.baseline_error is not None:
        meta["baseline"]["error"] = stack.baseline_error
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = [round(x, 2) for x in procs.loadavg()]
    doc: dict[str, Any] = {
        "meta": meta,
        "scenarios": results,
        "targets": report.evaluate_targets(results),
        "notes": notes(results, cores),
    }
    if failed:
        doc["notes"].insert(0, f"scenarios that failed to run: {', '.join(failed)}")
    try:
        plots = report_plots.plots(doc, out_dir)
        if not plots and not report_plots.have_matplotlib():
            doc["notes"].append("no plots: matplotlib is not installed (pip install -e '.[perf]')")
    except Exception as exc:  # a plot must never cost the figures
        plots = []
        doc["notes"].append(f"plots failed: {type(exc).__name__}: {exc}")
    doc["plots"] = plots
    report.write_json(doc, out_dir / "results.json")
    text = report.markdown(doc)
    (out_dir / "results.md").write_text(text)
    print(text, flush=True)
    _say(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}"
        + (f", {', '.join(plots)}" if plots else " (no plots)")
        + f" in {meta['elapsed_s']:.0f}s"
    )
    return 1 if failed else 0


def _run_one(
    runner: asyncio.Runner,
    stack: Stack,
    scenario: Scenario,
    rounds: int,
    duration: float,
    cores: int,
    quick: bool,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    _say(f"{scenario.name}: {scenario.title}")
    targets = ensure_targets(stack, scenario)
    result = ScenarioResult(scenario)
    if scenario.kind == "memory":
        delay, tokens = (0.2, 10) if quick else (0.5, 16)
        try:
            for target in targets:
                result.stats[target.name.removesuffix("-mem")] = INTERRUPTS.run(
                    runner, run_memory(target, scenario.streams, token_delay_s=delay, tokens=tokens)
                )
        finally:
            for target in targets:
                if target.kind == "peer":
                    stack.stop_peer(target.name)
                else:
                    stack.stop_router(target.name)
        return result.as_json()
    try:
        raw, profile = INTERRUPTS.run(runner, run_load(stack, scenario, targets, rounds, duration, profile_dir))
    finally:
        if scenario.kind == "sweep":
            for target in targets:
                if target.name.startswith("narwhal-w"):
                    stack.stop_router(target.name)
    for target in targets:
        result.stats[target.name] = summarize(target, raw[target.name], cores)
    compare(result.stats, raw)
    against_baseline(result.stats, raw)
    if profile is not None:
        result.extra["profile"] = profile
    if scenario.kind == "sweep":
        result.extra["workers"] = list(scenario.workers)
        result.extra["recommended_workers"] = recommend_workers(result.stats)
    return result.as_json()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
