"""The chaos suite's quick run (``python -m perf.chaos --quick``) as a test.

Runs as a subprocess so the suite's own processes (fake fleet, gunicorn router) are started and
stopped exactly as an operator would run it, and a hang is bounded by the subprocess timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from perf.chaos import ENGINE_EVENTS, PROCESS_EVENTS
from perf.chaos_faults import KINDS


def test_quick_chaos_run_meets_every_promise(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "perf.chaos", "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=150, cwd=Path(__file__).resolve().parents[2],
    )
    report_path = tmp_path / "chaos.json"
    assert report_path.exists(), proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["violations"] == 0, report["violation_samples"]
    assert report["leaks"] == [], report["leaks"]
    assert report["kv"]["leaked_handoffs"] == 0 and report["kv"]["never_decoded_outside_windows"] == 0, report["kv"]
    # Every fault kind of the catalogue met at least one request; every engine and process
    # fault happened at least once.
    assert set(report["request_faults_exercised"]) >= set(KINDS)
    assert set(report["engine_and_process_faults"]) >= set(ENGINE_EVENTS + PROCESS_EVENTS)
    assert report["requests"] >= 300
    assert report["outcomes"].get("ok", 0) > 0
    assert all(e["state"] == "admitted" for e in report["engines_end"]), report["engines_end"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
