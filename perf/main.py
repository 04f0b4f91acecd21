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
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf import baseline
from perf.load import procs
from perf.load.interrupts import INTERRUPTS
from perf.load.memory import run_memory
from perf.load.placement import run_placement
from perf.load.scarce import run_scarce
from perf.load.scenarios import (
    SCARCE_ROWS,
    Scenario,
    ScenarioResult,
    all_scenarios,
    ensure_targets,
    placement_scenarios,
    run_load,
    scarce_scenarios,
    select,
)
from perf.load.stack import Stack, expand_peer
from perf.report import plots as report_plots
from perf.report import results as report
from perf.report.notes import notes
from perf.report.summary import against_baseline, compare, recommend_workers, summarize

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options of README.md's table; values no run can use are refused here, not mid-run."""
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
        "--rows", default=None, metavar="A,B",
        help=f"prefix_scarce: only these rows (default all: {','.join(SCARCE_ROWS)})",
    )
    _add_comparison_options(p)
    args = p.parse_args(argv)
    rows = [r.strip() for r in (args.rows or "").split(",") if r.strip()]
    unknown = [r for r in rows if r not in SCARCE_ROWS]
    if unknown:
        p.error(f"--rows: unknown row {unknown[0]!r} (known: {', '.join(SCARCE_ROWS)})")
    args.rows = tuple(rows) or None
    if args.duration is not None and args.duration <= 0:
        p.error("--duration must be > 0")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def _add_comparison_options(p: argparse.ArgumentParser) -> None:
    """What the run measures Narwhal against (peer, baseline), profiles, and how the fleet is built."""
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


def _git() -> str:
    """The commit under test, marked when narwhal/ has uncommitted changes (they are what ran)."""

    def out(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip()

    try:
        rev, dirty = out("rev-parse", "--short", "HEAD"), out("status", "--porcelain", "--", "narwhal")
        return (rev or "unknown") + (" (narwhal/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _say(message: str) -> None:
    print(f"[perf] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Plan:
    """What every scenario of a run shares: its size, the host's cores, where it writes."""

    out_dir: Path
    rounds: int
    duration: float
    cores: int
    quick: bool
    profile: str | None  # --profile: the scenario that gets one extra round under py-spy
    rows: tuple[str, ...] | None = None  # --rows: prefix_scarce's rows to run (None: all)


def run(args: argparse.Namespace) -> int:
    """The phases of a run: plan, start the fleets and comparisons, run the scenarios, stop, report."""
    cores = os.cpu_count() or 1
    chosen: list[Scenario] = select(all_scenarios(args.quick, cores), args.scenarios,
        [*placement_scenarios(args.quick), *scarce_scenarios(args.quick)],
    )
    started = time.strftime("%Y%m%d-%H%M%S")
    plan = _plan(args, cores, started)
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    nofile = procs.raise_nofile_limit()
    meta = _meta(args, plan, started, nofile)
    results: dict[str, Any] = {}
    failed: list[str] = []
    t_start = time.monotonic()
    stack = Stack(plan.out_dir, workers=args.workers, coalesce=args.coalesce, fleet=args.fleet)
    INTERRUPTS.install()
    try:
        _say(f"results in {plan.out_dir}; starting fake engines")
        stack.start_fleets()
        if args.peer:
            _start_peer(stack, args.peer, meta)
        if args.baseline:
            _export_baseline(stack, args.baseline, plan.out_dir, meta)
        _run_scenarios(stack, chosen, plan, meta, results, failed)
    finally:
        _say("stopping processes")
        stack.close()
        INTERRUPTS.restore()

    if stack.baseline_error is not None:
        meta["baseline"]["error"] = stack.baseline_error
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = [round(x, 2) for x in procs.loadavg()]
    _write_report(meta, results, failed, plan)
    return 1 if failed else 0


def _plan(args: argparse.Namespace, cores: int, started: str) -> Plan:
    """The run's shape from the options; ``--quick`` changes the defaults, not explicit values."""
    quick: bool = args.quick
    return Plan(
        out_dir=Path(args.out) if args.out else RESULTS / started,
        rounds=args.rounds if args.rounds is not None else (1 if quick else 3),
        duration=args.duration if args.duration is not None else (0.5 if quick else 2.0),
        cores=cores,
        quick=quick,
        profile=args.profile,
        rows=args.rows,
    )


def _meta(args: argparse.Namespace, plan: Plan, started: str, nofile: tuple[int, int]) -> dict[str, Any]:
    """The report's header: how, where and on what this run ran (peer and baseline filled in later)."""
    return {
        "started": started,
        "quick": plan.quick,
        "cores": plan.cores,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": _git(),
        "workers": args.workers,
        "rounds": plan.rounds,
        "duration_s": plan.duration,
        "coalesce": args.coalesce,
        "nofile": list(nofile),
        "loadavg_start": [round(x, 2) for x in procs.loadavg()],
        "topology": "1 producer + 1 consumer fake engine, "
        + ("each in its own process" if args.fleet == "split" else "both in one process"),
        "fleet": args.fleet,
        "peer": {"command": None, "error": None},
        "baseline": {"ref": args.baseline, "commit": None, "error": None},
    }


def _start_peer(stack: Stack, command: str, meta: dict[str, Any]) -> None:
    """``--peer``: a peer that does not start is reported, and the run goes on without it."""
    _say(f"starting peer: {expand_peer(command)}")
    peer = stack.start_peer(command)
    meta["peer"] = {"command": peer.detail["command"] if peer else None, "error": stack.peer_error}
    if peer is None:
        _say(f"peer not used: {stack.peer_error}")


def _export_baseline(stack: Stack, ref: str, out_dir: Path, meta: dict[str, Any]) -> None:
    """``--baseline``: REF's ``narwhal/`` into ``<out>/baseline``; a REF that is no commit is reported."""
    try:
        meta["baseline"]["commit"] = baseline.export(ref, REPO, out_dir / "baseline")
        stack.baseline_root = str((out_dir / "baseline").resolve())
        _say(f"baseline: {ref} = {meta['baseline']['commit'][:12]}")
    except baseline.BaselineError as exc:
        meta["baseline"]["error"] = str(exc)
        _say(f"baseline not used: {exc}")


def _run_scenarios(
    stack: Stack,
    chosen: list[Scenario],
    plan: Plan,
    meta: dict[str, Any],
    results: dict[str, Any],
    failed: list[str],
) -> None:
    """Every scenario in one event loop; one that fails is recorded and the next one runs.

    ``results.json`` is rewritten after each scenario (``"partial": true``) so an interrupted
    or crashed run still leaves the figures it measured.
    """
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a narwhal dependency
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        for scenario in chosen:
            t0 = time.monotonic()
            try:
                profile = plan.out_dir if plan.profile == scenario.name else None
                results[scenario.name] = _run_one(runner, stack, scenario, plan, profile)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                failed.append(scenario.name)
                results[scenario.name] = _failure(scenario, exc)
                _say(f"{scenario.name} FAILED: {exc}")
                traceback.print_exc(file=sys.stderr)
            _say(f"{scenario.name} done in {time.monotonic() - t0:.1f}s")
            report.write_json({"meta": meta, "scenarios": results, "partial": True}, plan.out_dir / "results.json")


def _failure(scenario: Scenario, exc: Exception) -> dict[str, Any]:
    """A scenario that could not run, shaped like one that did (no targets) so the report lists it."""
    return {
        "name": scenario.name,
        "kind": scenario.kind,
        "title": scenario.title,
        "concurrency": scenario.concurrency,
        "error": f"{type(exc).__name__}: {exc}",
        "targets": {},
    }


def _write_report(meta: dict[str, Any], results: dict[str, Any], failed: list[str], plan: Plan) -> None:
    """The final ``results.json``, the plots and ``results.md``, which is printed too."""
    doc: dict[str, Any] = {
        "meta": meta,
        "scenarios": results,
        "targets": report.evaluate_targets(results),
        "notes": notes(results, plan.cores),
    }
    if failed:
        doc["notes"].insert(0, f"scenarios that failed to run: {', '.join(failed)}")
    try:
        plots = report_plots.plots(doc, plan.out_dir)
        if not plots and not report_plots.have_matplotlib():
            doc["notes"].append("no plots: matplotlib is not installed (pip install -e '.[perf]')")
    except Exception as exc:  # a plot must never cost the figures
        plots = []
        doc["notes"].append(f"plots failed: {type(exc).__name__}: {exc}")
    doc["plots"] = plots
    out_dir = plan.out_dir
    report.write_json(doc, out_dir / "results.json")
    text = report.markdown(doc)
    (out_dir / "results.md").write_text(text)
    print(text, flush=True)
    _say(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}"
        + (f", {', '.join(plots)}" if plots else " (no plots)")
        + f" in {meta['elapsed_s']:.0f}s"
    )


def _run_one(
    runner: asyncio.Runner, stack: Stack, scenario: Scenario, plan: Plan, profile_dir: Path | None = None
) -> dict[str, Any]:
    _say(f"{scenario.name}: {scenario.title}")
    result = ScenarioResult(scenario)
    if scenario.kind == "placement":
        result.stats = run_placement(
            runner, scenario, rounds=plan.rounds, duration_s=plan.duration, quick=plan.quick,
            out_dir=plan.out_dir, workers=stack.workers, cores=plan.cores, peer=stack.peer_template,
        )
        return result.as_json()
    if scenario.kind == "scarce":
        scarce = run_scarce(
            runner, scenario, rounds=plan.rounds, duration_s=plan.duration, out_dir=plan.out_dir,
            workers=stack.workers, cores=plan.cores, peer=stack.peer_template, rows=plan.rows,
        )
        result.stats = scarce.pop("targets")
        result.extra.update(scarce)
        return result.as_json()
    targets = ensure_targets(stack, scenario)
    if scenario.kind == "memory":
        delay, tokens = (0.2, 10) if plan.quick else (0.5, 16)
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
        load = run_load(stack, scenario, targets, plan.rounds, plan.duration, profile_dir)
        raw, profile = INTERRUPTS.run(runner, load)
    finally:
        if scenario.kind == "sweep":
            for target in targets:
                if target.name.startswith("narwhal-w"):
                    stack.stop_router(target.name)
    for target in targets:
        result.stats[target.name] = summarize(target, raw[target.name], plan.cores)
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
