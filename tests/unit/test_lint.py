"""The house's checkers run with the suite: ruff over the code and the tests, mypy (strict, as
``pyproject.toml`` configures it) over ``narwhal/``.

Why in the suite and not only in an editor: both were clean by habit and drifted twice (mypy
found eight errors in the decode path's types a round after they came in). A check that runs
where CI runs cannot drift. ``perf/`` is linted but not type-checked: its tools are scripts
around the package, and the package's types are the contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", "--no-cache", "narwhal", "perf", "tests")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing_in_the_package() -> None:
    done = _run("mypy", "--no-incremental", "narwhal")
    assert done.returncode == 0, done.stdout + done.stderr
