"""The test harness leaves nothing behind: a settings file written by ``write_config`` is gone
once the process that wrote it exits (a full test session writes hundreds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_WRITE = (
    "from narwhal.testing.harness import write_config\n"
    "engines = [{'name': 'p0', 'url': 'http://127.0.0.1:9', 'role': 'producer'}]\n"
    "path = write_config(engines, {'server': {'workers': 1}})\n"
    "print(path, open(path).read().count('[[engines]]'), flush=True)\n"
)


def _run(*args: str) -> str:
    argv = [sys.executable, "-c", *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_a_written_settings_file_is_removed_when_its_writer_exits() -> None:
    path, engines = _run(_WRITE).split()
    assert engines == "1"  # it was there, with its one engine, while the writer ran
    assert path.startswith("/") and not os.path.exists(path)


def test_a_settings_file_moved_away_is_kept(tmp_path: Path) -> None:
    # What tests that own the path do (shutil.move to tmp_path): the moved file is theirs.
    script = _WRITE + "import os, sys; os.replace(path, sys.argv[1])\n"
    target = tmp_path / "kept.toml"
    _run(script, str(target))
    assert "[[engines]]" in target.read_text()
