"""The perf suite's CI smoke run: ``python -m perf --quick`` must *work* (not be fast).

Why a subprocess: the suite is a command that starts fake engines and gunicorn routers and must
clean up after itself; running it exactly as a user does is the only way to test that. The
numbers are not checked (CI machines are small and shared); what is checked is that every
scenario ran, sent traffic, met no errors where none are expected, and that the reports exist.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf.load.scenarios import all_scenarios

REPO = Path(__file__).resolve().parents[3]
EXPECTED = {
    "stream_c1",
    "stream_c32",
    "stream_c128",
    "paced_c128",
    "paced_c1000",
    "nonstream_c32",
    "chat_c32",
    "responses_c32",
    "messages_c32",
    "accesslog_c32",
    "workers",
    "memory",
}


# The whole quick run, twelve scenarios, on a loaded 2-core host: bounded, not timed.
def run_perf(out: Path, *args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    """``python -m perf --quick ARGS --out OUT`` exactly as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    return subprocess.run(
        [sys.executable, "-m", "perf", "--quick", *args, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(240)
def test_quick_run_works(tmp_path: Path) -> None:
    # With a --baseline that is no commit: it is refused before the first scenario, so every
    # scenario runs as in a plain --quick run, and that run shows the refusal is reported, not
    # fatal (a run of its own cost ~15 s; the run without --baseline is the prefix_scarce one's).
    # Half the quick run's measured time per target: the smoke asks that every scenario works, not
    # for figures, and the suite's time is short.
    proc = run_perf(tmp_path, "--baseline", "no-such-ref", "--duration", "0.25")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["baseline"]["commit"] is None
    assert doc["meta"]["baseline"]["error"] == f"--baseline 'no-such-ref' is not a commit of {REPO}"
    assert "baseline: `no-such-ref` not run (--baseline 'no-such-ref' is not a commit of" in proc.stdout
    scenarios = doc["scenarios"]
    names = {s.name for s in all_scenarios(quick=True)}
    assert EXPECTED <= names
    assert set(scenarios) == names
    for name, res in scenarios.items():
        assert "error" not in res, (name, res.get("error"))
        assert "baseline" not in res["targets"], name  # the refused baseline ran nowhere
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
    # The aiohttp floor runs beside Narwhal where the scenarios name it, and the notes compare.
    for name in ("stream_c1", "stream_c32", "nonstream_c32"):
        floor = scenarios[name]["targets"]["aiohttp-floor"]
        assert floor["requests"] > 0 and floor["router_cpu_us_per_req"] is not None, name
    assert "aiohttp floor (`perf/load/floor_proxy.py`" in (tmp_path / "results.md").read_text()
    assert scenarios["workers"]["recommended_workers"] in scenarios["workers"]["workers"]
    assert len(doc["targets"]) == 12 and all(t["result"] in ("PASS", "FAIL", "n/a") for t in doc["targets"])
    # The ratios are judged from this run's own figures: the smoke has no peer, chat_long ran.
    by_name = {t["target"]: t for t in doc["targets"]}
    assert by_name["router CPU per request ×peer, stream_c32"]["result"] == "n/a"
    assert isinstance(by_name["router CPU per request, chat_long ×chat_c32"]["narwhal"], float)

    table = (tmp_path / "results.md").read_text()
    assert "| scenario | target | req/s |" in table
    assert "## Targets" in table and "Recommended `server.workers`" in table
    assert "| scenario | target | req/s |" in proc.stdout  # the table is printed too


def _git_head() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@pytest.mark.timeout(120)
def test_baseline_runs_in_the_same_rounds(tmp_path: Path) -> None:
    head = _git_head()
    if head is None:
        pytest.skip("not a git checkout: --baseline needs one")
    proc = run_perf(tmp_path, "--scenarios", "nonstream", "--baseline", "HEAD", "--duration", "0.25", timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["baseline"] == {"ref": "HEAD", "commit": head, "error": None}
    assert (tmp_path / "baseline" / "narwhal" / "__init__.py").is_file()
    targets = doc["scenarios"]["nonstream_c32"]["targets"]
    assert targets["baseline"]["requests"] > 0 and targets["baseline"]["errors"]["count"] == 0
    vs = targets["narwhal"]["vs_baseline"]
    assert vs["cpu_ratio"] > 0 and vs["rps_ratio"] > 0 and len(vs["cpu_ratio_rounds"]) == 1
    assert f"## This checkout against the baseline (HEAD = {head[:12]})" in (tmp_path / "results.md").read_text()


def test_a_router_started_from_another_root_runs_that_code(tmp_path: Path) -> None:
    # What --baseline relies on: RouterProcess(root=...) serves the narwhal package found there.
    root = tmp_path / "other"
    shutil.copytree(REPO / "narwhal", root / "narwhal", ignore=shutil.ignore_patterns("__pycache__"))
    app = root / "narwhal" / "worker" / "app.py"
    source = app.read_text()
    assert '{"status": "ok", "worker": os.getpid()}' in source
    app.write_text(source.replace('{"status": "ok", "worker"', '{"status": "ok-from-other-root", "worker"'))
    fleet = FakeFleet.start(["p0", "d0"], args=["--model", "m"])
    try:
        config = write_config(
            [{"name": "p0", "url": fleet.engines["p0"], "role": "producer"},
             {"name": "d0", "url": fleet.engines["d0"], "role": "consumer"}],
            {"preflight": {"on_start": False}, "log": {"access_log": ""}},
        )
        router = RouterProcess.start(config, root=str(root), log_path=str(tmp_path / "router.log"), timeout=60)
        try:
            status, body = http_get(router.url + "/health")
            assert status == 200 and json.loads(body)["status"] == "ok-from-other-root"
        finally:
            router.stop()
    finally:
        fleet.stop()


SCARCE_ROWS = ("held", "held-2-replicas", "affinity", "ideal")


@pytest.mark.timeout(90)
def test_prefix_scarce_wires_up(tmp_path: Path) -> None:
    # The slow variant (its targets are a superset), the rows that need no peer, one worker per
    # router: ~10 s. The held rows run once the policy exists, else they say why not.
    proc = run_perf(
        tmp_path, "--scenarios", "prefix_scarce_slow", "--rows", ",".join(SCARCE_ROWS), "--workers", "1", timeout=80
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((tmp_path / "results.json").read_text())["scenarios"]["prefix_scarce_slow"]
    assert res["kind"] == "scarce" and "error" not in res, res.get("error")
    assert res["variant"] == {"zipf_s": 0.0, "slow": "p3"}
    assert {"affinity", "ideal"} <= set(res["targets"])
    assert sorted([*res["targets"], *res["unavailable"]]) == sorted(SCARCE_ROWS)
    for row, why in res["unavailable"].items():
        assert row in ("held", "held-2-replicas") and why.startswith('not available: ') and '"held"' in why, why
    for row, stats in res["targets"].items():
        assert stats["requests"] > 0 and stats["errors"]["count"] == 0, (row, stats["errors"])
        assert stats["ttfb_ms"]["p50"] is not None and 0.0 <= stats["cached_share"] <= 1.0, row
        per = stats["producers"]["per_producer"]
        assert sorted(per) == ["p0", "p1", "p2", "p3"] and sum(p["prefills"] for p in per.values()) > 0, row
        assert isinstance(stats["producers"]["slow_share_ratio"], float), row
        if row == "ideal":
            assert stats["router_cpu_us_per_req"] is None and stats["router_ttft_ms"]["p50"] is None
        else:
            assert stats["router_cpu_us_per_req"] > 0 and stats["router_ttft_ms"]["p50"] > 0, row
    table = (tmp_path / "results.md").read_text()
    assert "## Scarce KV (prefix_scarce)" in table and "| prefix_scarce target | figure | threshold | result |" in table
    lines = [line for line in table.splitlines() if line.startswith("| prefix_scarce_slow: ")]
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in lines]
    assert len(verdicts) == 7 and set(verdicts) <= {"PASS", "FAIL", "n/a"}
    assert [v["result"] for v in res["verdicts"]] == verdicts  # the same verdicts in results.json
