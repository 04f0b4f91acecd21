"""What the ``narwhal`` command prints at its edges: its version, a busy demo port, a closed pipe.

Each of these once ended in a traceback or in the wrong name; here each must be one exact line.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

from narwhal.testing.harness import FakeFleet, write_config

ROOT = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def _narwhal(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", "narwhal", *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=60, **kwargs,
    )


def test_version_is_the_installed_distributions_which_is_pyprojects() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pyproject["name"] == "narwhal-router"
    assert metadata.version("narwhal-router") == pyproject["version"]
    proc = _narwhal("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"narwhal-router {pyproject['version']}\n", "")


def test_the_demo_default_port_is_not_vllms() -> None:
    proc = _narwhal("demo", "--help")
    assert proc.returncode == 0
    assert "router port (default 8080, off vLLM's own 8000; 0 picks a free one)" in " ".join(proc.stdout.split())
    assert "the router under gunicorn on 127.0.0.1:8080" in (ROOT / "README.md").read_text()


def test_demo_on_a_busy_port_says_so_in_one_line_and_starts_nothing() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = _narwhal("demo", "--port", str(port))
        elapsed = time.monotonic() - started
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == (
        f"narwhal demo: 127.0.0.1:{port} is already in use; pick another port with --port N (0 picks a free one)\n"
    )
    # Refused before the fake fleet (a second Python process, ~1 s to start) was launched.
    assert elapsed < 10


def test_a_reader_that_closed_the_pipe_ends_preflight_with_one_line(fleet: FakeFleet, tmp_path: Path) -> None:
    config = tmp_path / "narwhal.toml"
    shutil.move(write_config(
        [{"name": "p0", "url": fleet.engines["p0"], "role": "producer"},
         {"name": "d0", "url": fleet.engines["d0"], "role": "consumer"}],
        {"engine": {"prefill_timeout_s": 3, "first_token_timeout_s": 3}},
    ), config)
    # `narwhal preflight --json | head -c0`, without the race: the read end is closed before
    # the command writes anything, so its first write fails with EPIPE.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "narwhal", "preflight", "--json", "--config", str(config)],
            cwd=ROOT, env=_env(), stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
        )
    finally:
        os.close(write_end)
    *progress, last = proc.stderr.splitlines()  # one line per engine and pair as each ended, then the one line
    assert last == "narwhal preflight: output not fully written: the reader closed the pipe"
    assert len(progress) == 3 and all(line.startswith("preflight: ") for line in progress)
    assert proc.returncode == 141
