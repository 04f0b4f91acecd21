"""``--profile``: sample Narwhal's gunicorn workers with py-spy during one round, summarise the stacks.

Why py-spy: it attaches to a running process from outside (no change to the router, no import
hook), so the profile is of the very processes the figures come from. ``--nonblocking`` keeps it
from pausing the worker at every sample (which would distort the run it measures). It is optional
(``pip install py-spy``): without it ``--profile`` says so and the run goes on.

The summary counts samples whose stack contains a function ("inclusive") or ends in it ("self"),
as a share of all samples; the raw collapsed stacks are kept for flame-graph tools.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from perf.load import procs

RATE_HZ = 200
# Frames every worker stack has (gunicorn and the event loop's own entry): noise in a top list.
_BORING = (
    "<frozen runpy>",
    "wsgiapp.py",
    "arbiter.py",
    "gunicorn/app/base.py",
    "gunicorn/workers/base.py",
    "aiohttp/worker.py",
    "__main__.py",
)


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


class Profiler:
    """py-spy on every gunicorn worker of a router for ``seconds``."""

    def __init__(self, root_pids: list[int], seconds: float, out_dir: Path, label: str) -> None:
        self.procs: list[tuple[int, Path, subprocess.Popen[bytes]]] = []
        exe = py_spy()
        if exe is None:
            raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
        workers = [p for p in procs.tree(root_pids) if procs.role(p) == "workers"]
        for pid in workers:
            path = out_dir / f"profile-{label}-{pid}.txt"
            cmd = [
                exe,
                "record",
                "--nonblocking",
                "-r",
                str(RATE_HZ),
                "-d",
                str(max(1, round(seconds))),
                "--format",
                "raw",
                "-o",
                str(path),
                "-p",
                str(pid),
            ]
            self.procs.append((pid, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))

    def wait(self, timeout: float = 30.0) -> list[Path]:
        done: list[Path] = []
        for _, path, proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if path.exists():
                done.append(path)
        return done


def _frame(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``."""
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    file = where.split(":")[0].rstrip(")")
    return f"{name} ({'/'.join(file.split('/')[-2:])})"


def summarize(paths: list[Path], top: int = 20) -> dict[str, Any]:
    """Self and inclusive shares of the hottest functions over every collapsed-stack file."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = [f for f in stack.split(";") if not any(b in f for b in _BORING)]
            if not frames:
                continue
            for name in {_frame(f) for f in frames}:
                inclusive[name] += n
            own[_frame(frames[-1])] += n
    if not total:
        return {"samples": 0, "self": [], "inclusive": []}

    def share(counter: Counter[str]) -> list[dict[str, Any]]:
        return [{"function": k, "pct": round(100.0 * v / total, 1)} for k, v in counter.most_common(top)]

    return {"samples": total, "files": [p.name for p in paths], "self": share(own), "inclusive": share(inclusive)}
