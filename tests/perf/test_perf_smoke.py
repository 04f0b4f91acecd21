"""The perf suite's CI smoke run: ``python -m perf --quick`` must *work* (not be fast).

Why a subprocess: the suite is a command that starts fake engines and gunicorn routers and must
clean up after itself; running it exactly as a user does is the only way to test that. The
numbers are not checked (CI machines are small and shared); what is checked is that every
scenario ran, sent traffic, met no errors where none are expected, and that the reports exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perf.scenarios import all_scenarios

REPO = Path(__file__).resolve().parents[2]
EXPECTED = {
    "stream_c1",
    "stream_c32",
    "stream_c128",
    "paced_c128",
    "paced_c1000",
    "nonstream_c32",
    "chat_c32",
    "accesslog_c32",
    "workers",
    "memory",
}


@pytest.mark.timeout(180)
def test_quick_run_works(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    proc = subprocess.run(
        [sys.executable, "-m", "perf", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    doc = json.loads((tmp_path / "results.json").read_text())
    scenarios = doc["scenarios"]
    names = {s.name for s in all_scenarios(quick=True)}
    assert EXPECTED <= names
    assert set(scenarios) == names
    for name, res in scenarios.items():
        assert "error" not in res, (name, res.get("error"))
        assert res["targets"], name
        for target, stats in res["targets"].items():
            if res["kind"] == "memory":
                assert stats["open_at_peak"] > 0, (name, target)
            else:
                assert stats["requests"] > 0, (name, target)
                assert stats["rps"] > 0 and stats["ttfb_ms"]["p50"] is not None, (name, target)
            if not res["expects_errors"]:
                assert stats["errors"]["count"] == 0, (name, target, stats["errors"])
        if res["kind"] == "load":
            assert {"narwhal", "direct"} <= set(res["targets"]), name
            assert res["targets"]["narwhal"]["router_cpu_us_per_req"] is not None, name
    assert scenarios["workers"]["recommended_workers"] in scenarios["workers"]["workers"]
    assert len(doc["targets"]) == 6 and all(t["result"] in ("PASS", "FAIL", "n/a") for t in doc["targets"])

    table = (tmp_path / "results.md").read_text()
    assert "| scenario | target | req/s |" in table
    assert "## Targets" in table and "Recommended `server.workers`" in table
    assert "| scenario | target | req/s |" in proc.stdout  # the table is printed too
