"""Reading figures out of a run's results, and judging them: the helpers every report section shares.

Why one module: the load, placement and scarce reports all walk the same nested results (scenario
→ targets → stats) and print the same three verdicts; written once, a missing figure is ``None``
and "n/a" the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def dig(value: Any, *path: str) -> Any:
    """``value[path[0]][path[1]]…``, or None as soon as a step is missing or not a mapping."""
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def figure(results: dict[str, Any], scenario: str, target: str, *path: str) -> Any:
    """A figure of one target in one scenario (``path`` into its stats), or None."""
    return dig(results.get(scenario, {}).get("targets", {}).get(target), *path)


def ratio(a: Any, b: Any) -> float | None:
    """``a / b`` to three places, or None when either is missing or ``b`` is 0."""
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def verdict(ok: bool | None) -> str:
    """PASS, FAIL, or n/a when the figure it needs is missing."""
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def judged(value: float | None, ok: Callable[[float], bool]) -> str:
    """The verdict of ``ok(value)``; n/a when there is no value."""
    return verdict(None if value is None else ok(value))


def save_plot(plt: Any, fig: Any, out_dir: Path, name: str) -> str:
    """Lay out, write ``out_dir/name`` at the report's resolution and free the figure; its file name."""
    fig.tight_layout()
    path = out_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
