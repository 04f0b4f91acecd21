"""The report's PNG plots: throughput and p99 TTFB against concurrency, and against workers.

matplotlib is optional (``pip install -e '.[perf]'``): without it ``plots`` writes nothing and
says so by returning no file names, and the caller adds the note. It is imported inside
``plots`` only, with the Agg backend, so a run never needs a display and importing the report
never needs matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perf.report import placement as placement_report
from perf.report.figures import save_plot

COLORS = {"narwhal": "C0", "peer": "C1", "direct-pd": "C2", "aiohttp-floor": "C3", "direct": "C7"}
# One line per target and family: "<target> (<family>)|<line style>" -> (concurrency, req/s, TTFB p99).
Series = dict[str, list[tuple[int, float, float | None]]]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plots(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """PNG plots when matplotlib is installed (``pip install -e '.[perf]'``); else a notice."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[str] = []
    results = {k: v for k, v in doc["scenarios"].items() if "error" not in v}
    series = _concurrency_series(results)
    if series:
        written.append(_plot_concurrency(plt, series, out_dir))
    sweep = results.get("workers")
    if sweep and sweep["targets"]:
        written.append(_plot_workers(plt, sweep, out_dir))
    placement = placement_report.plot(plt, results, out_dir)
    if placement is not None:
        written.append(placement)
    return written


def _concurrency_series(results: dict[str, Any]) -> Series:
    """The streaming (solid) and paced (dashed) load scenarios, as one line per target each."""
    series: Series = {}
    for family, style in (("stream_c", "-"), ("paced_c", "--")):
        for name, res in results.items():
            if res["kind"] != "load" or not name.startswith(family):
                continue
            for target, s in res["targets"].items():
                key = f"{target} ({family.rstrip('_c')})|{style}"
                series.setdefault(key, []).append((res["concurrency"], s["rps"], s["ttfb_ms"]["p99"]))
    return series


def _plot_concurrency(plt: Any, series: Series, out_dir: Path) -> str:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, points in series.items():
        label, style = key.split("|")
        color = COLORS.get(label.split(" (")[0])
        points.sort()
        xs = [p[0] for p in points]
        ax1.plot(xs, [p[1] for p in points], style, marker="o", label=label, color=color)
        ax2.plot(xs, [p[2] for p in points], style, marker="o", label=label, color=color)
    for ax, title in ((ax1, "throughput (req/s)"), (ax2, "TTFB p99 (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    return save_plot(plt, fig, out_dir, "concurrency.png")


def _plot_workers(plt: Any, sweep: dict[str, Any], out_dir: Path) -> str:
    pts = sorted(
        (int(t.removeprefix("narwhal-w")), s["rps"], s["ttfb_ms"]["p99"])
        for t, s in sweep["targets"].items()
        if t.startswith("narwhal-w")
    )
    direct = sweep["targets"].get("direct")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="narwhal")
    ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label="narwhal")
    if direct:
        ax1.axhline(direct["rps"], linestyle=":", color="gray", label="direct")
        if direct["ttfb_ms"]["p99"] is not None:
            ax2.axhline(direct["ttfb_ms"]["p99"], linestyle=":", color="gray", label="direct")
    for ax, title in ((ax1, "throughput (req/s)"), (ax2, "TTFB p99 (ms)")):
        ax.set_xlabel("gunicorn workers")
        ax.set_xticks([p[0] for p in pts])
        ax.set_title(f"{title}, c={sweep['concurrency']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_plot(plt, fig, out_dir, "workers.png")
