"""The chaos suite's quick run (``python -m perf.chaos --quick``) as a test.

Runs as a subprocess so the suite's own processes (fake fleet, gunicorn router) are started and
stopped exactly as an operator would run it, and a hang is bounded by the subprocess timeout.
One run, two tests: the fault mix and the poison storm that follows it (``perf.chaos.storm``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from perf.chaos.dead_consumer import MIN_CLEAN_SHARE as MIN_DEAD_CONSUMER_SHARE
from perf.chaos.faults import KINDS
from perf.chaos.run import ENGINE_EVENTS, PROCESS_EVENTS
from perf.chaos.storm import MIN_CLEAN_SHARE, POISON_SHARE

QuickRun = tuple[subprocess.CompletedProcess[str], dict[str, Any]]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    out = tmp_path_factory.mktemp("chaos")
    proc = subprocess.run(
        [sys.executable, "-m", "perf.chaos", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=230, cwd=Path(__file__).resolve().parents[3],
    )
    report_path = out / "chaos.json"
    assert report_path.exists(), proc.stdout + proc.stderr
    return proc, json.loads(report_path.read_text())


@pytest.mark.timeout(240)
def test_quick_chaos_run_meets_every_promise(quick_run: QuickRun) -> None:
    proc, report = quick_run
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


@pytest.mark.timeout(240)
def test_a_dead_consumer_takes_no_traffic_while_the_other_is_ejected_but_reachable(quick_run: QuickRun) -> None:
    # Before, nearly every request went to the dead consumer and answered 502.
    _, report = quick_run
    sequence = report["dead_consumer"]
    assert sequence["ejected"] and sequence["failed"] == [], sequence["failed"]
    assert sequence["clean"] >= 100 and sequence["clean_success_share"] >= MIN_DEAD_CONSUMER_SHARE, sequence


@pytest.mark.timeout(240)
def test_a_poison_storm_leaves_clean_requests_served(quick_run: QuickRun) -> None:
    _, report = quick_run
    (storm,) = report["poison_storm"]
    assert (storm["max_ejected_fraction"], storm["poison_share"], storm["recovery.failure_quarantine_s"]) == (
        0.5, POISON_SHARE, 1.0)
    assert storm["failed"] == [], storm["failed"]
    assert storm["violations"] == 0, storm["violation_samples"]
    assert storm["clean"] >= 200 and storm["poisoned"] >= 200, storm
    assert storm["clean_success_share"] >= MIN_CLEAN_SHARE, storm["clean_failures"]
    # The storm really bit: poisoned requests failed (they never succeed), and some breaker
    # sample caught every producer quarantined or out, so placement's fallback was needed.
    assert storm["poisoned_outcomes"].get("ok", 0) == 0
    assert storm["roles"]["producer"]["all_out_or_quarantined"] > 0, storm["roles"]


@pytest.mark.timeout(240)
def test_a_consumer_killed_under_load_cuts_no_stream(quick_run: QuickRun) -> None:
    # Migration: with migrations on, every stream running on the killed consumer completes whole.
    _, report = quick_run
    sequence = report["killed_consumer"]
    assert sequence["failed"] == [], sequence["failed"]
    assert sequence["in_flight_at_kill"] >= 8 and sequence["migrations"] >= 1, sequence
    assert sequence["cut_streams"] == 0, sequence["outcomes"]
