"""``--baseline REF``: the ``narwhal`` package of another commit, to measure beside this one.

Why an export and not a worktree: ``git archive`` of the one directory writes nothing into the
repository (no worktree to forget to remove) and takes a fraction of a second. The baseline runs
with this checkout's installed dependencies, so a REF that needs other versions will not start;
the suite then reports the baseline as not run and carries on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

PACKAGE = "narwhal"
REPO = Path(__file__).resolve().parent.parent  # this checkout: its perf/ measures every target
T = TypeVar("T")


class BaselineError(RuntimeError):
    pass


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BaselineError(f"git is not usable here: {exc}") from None


def export(ref: str, repo: Path, dest: Path) -> str:
    """Write REF's ``narwhal/`` under ``dest`` and return the full commit id."""
    resolved = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if resolved.returncode != 0:
        raise BaselineError(f"--baseline {ref!r} is not a commit of {repo}")
    commit = resolved.stdout.decode().strip()
    archive = subprocess.Popen(
        ["git", "-C", str(repo), "archive", "--format=tar", commit, PACKAGE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert archive.stdout is not None
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
            tar.extractall(dest, filter="data")
    except tarfile.TarError as exc:
        archive.kill()
        raise BaselineError(f"could not unpack {ref}'s {PACKAGE}/: {exc}") from None
    finally:
        stderr = archive.communicate()[1]
    if archive.returncode != 0:
        raise BaselineError(f"git archive {ref} {PACKAGE}: {stderr.decode(errors='replace').strip()}")
    if not (dest / PACKAGE / "__init__.py").is_file():
        raise BaselineError(f"{ref} has no {PACKAGE}/ package")
    return commit


def targets(refs: str | None, repo: Path, *, checkout: bool = True) -> list[tuple[str, str | None]]:
    """What a comparing tool measures: this checkout (root None) unless ``checkout`` is false,
    then each commit of the comma-separated ``refs``, exported, as ``(label, root)``. Raises
    :class:`BaselineError` naming the first ref that is not a commit."""
    found: list[tuple[str, str | None]] = [("checkout", None)] if checkout else []
    for ref in [r for r in (refs or "").split(",") if r]:
        dest = Path(tempfile.mkdtemp(prefix="narwhal-baseline-"))
        found.append((f"{ref} ({export(ref, repo, dest)[:10]})", str(dest)))
    return found


def targets_or_exit(refs: str | None, prog: str, *, checkout: bool = True) -> list[tuple[str, str | None]]:
    """:func:`targets` of this checkout, or the reason on stderr as ``prog: ...`` and exit status 2."""
    try:
        return targets(refs, REPO, checkout=checkout)
    except BaselineError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def interleaved(targets: list[tuple[str, str | None]], rounds: int, measure: Callable[[str | None], T]) -> dict[
        str, list[T]]:
    """``measure(root)`` of every target, ``rounds`` times over, the targets interleaved within
    each round: a drift of the host hits every target alike."""
    figures: dict[str, list[T]] = {name: [] for name, _ in targets}
    for _ in range(rounds):
        for name, root in targets:
            figures[name].append(measure(root))
    return figures


def child_figures(module: str, root: str | None, args: list[str], timeout: float) -> tuple[float, float]:
    """``python -m <module> --child <args>`` in a fresh process over the ``narwhal`` at ``root``
    (this checkout's when None): the two figures its last line prints (CPU, calls)."""
    env = dict(os.environ)
    if root is not None:  # `python -m` puts its working directory first on sys.path: run from root
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, str(REPO), env.get("PYTHONPATH"))))
    out = subprocess.run([sys.executable, "-m", module, "--child", *args], env=env, capture_output=True, text=True,
                         timeout=timeout, check=True, cwd=root or REPO)
    cpu, calls = out.stdout.split()[-2:]
    return float(cpu), float(calls)
