"""Shared by the settings tests: config files in a temporary directory, the one-line error they give, a clean
environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from narwhal.settings import SettingsError, load_settings

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = str(REPO / ".venv" / "bin" / "python")
NOT_A_NUMBER = (
    "engine.first_token_timeout_s: Input should be a valid number, unable to parse string as a number"
)
BAD_TIMEOUT_TOML = '[engine]\nfirst_token_timeout_s = "soon"\n'

TWO_ENGINES = """
[[engines]]
name = "p0"
url = "http://10.0.0.5:8100"
role = "producer"

[[engines]]
name = "d0"
url = "http://10.0.0.6:8200"
role = "consumer"
"""


def write(tmp_path: Path, text: str, name: str = "narwhal.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(tmp_path: Path, toml: str | None, environ: dict[str, str] | None = None) -> str:
    path = write(tmp_path, toml) if toml is not None else None
    with pytest.raises(SettingsError) as info:
        load_settings(path, environ={} if environ is None else environ)
    message = str(info.value)
    assert "\n" not in message
    return message


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("NARWHAL_", "PROMETHEUS_MULTIPROC_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def assert_one_line_exit(proc: subprocess.CompletedProcess[str], key_prefix: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"narwhal: invalid settings: {key_prefix}"), lines[0]


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=30)
