"""The alert rules: promtool checks them and runs their unit tests, on series shaped like the scrapes.

Why: an alert that matches no series never fires, and nothing says so. NarwhalRouterDown once
matched ``up{job="narwhal"}`` while the shipped PodMonitor produced ``job="llm/narwhal"``. These
tests tie the job label to both scrape paths, run ``promtool test rules`` on the rules' unit
tests, and keep the PrometheusRule identical to ``deploy/prometheus/alerts.yml``. promtool comes
from Debian's ``prometheus`` package, which ``.ci/run`` unpacks where apt-get runs as root.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.unit.deploy.deploy_support import ALERTS, ALERTS_TEST, DEPLOY, JOB, ROOT, manifests


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (.ci/run installs it where apt-get runs as root)")
    return promtool


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_alert_rules_pass_promtool() -> None:
    proc = subprocess.run([_promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


def test_alert_rules_fire_on_series_shaped_like_the_scrapes() -> None:
    proc = subprocess.run([_promtool(), "test", "rules", str(ALERTS_TEST)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("SUCCESS")


def test_the_rule_tests_use_the_job_both_scrape_paths_produce() -> None:
    # Static scrape config: job_name. Prometheus Operator: the value of the pod label that the
    # PodMonitor's jobLabel names (its default, "<namespace>/<name>", would match no alert).
    (job,) = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())["scrape_configs"]
    docs = manifests()
    monitor = docs["PodMonitor"]
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert job["job_name"] == pod_labels[monitor["spec"]["jobLabel"]] == JOB
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    series = [s["series"] for t in tests["tests"] for s in t["input_series"]]
    assert series[0].startswith(f'up{{job="{JOB}", ')
    # The test of the operator's default job name uses exactly that name.
    default_job = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    assert series[1].startswith(f'up{{job="{default_job}", ')


def test_the_prometheusrule_carries_exactly_the_alert_rules() -> None:
    rule = manifests()["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "llm"
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_ci_runs_exactly_the_readme_test_command_after_installing_promtool() -> None:
    readme = (ROOT / "README.md").read_text()
    command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    assert f"\n{command}\n" in readme
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    calls = [line for line in lines if not line.startswith((" ", "\t", "}", "set ", "cd ")) and "()" not in line]
    # A failed install skips the promtool tests; it never stops CI before the test command.
    assert calls[0] == 'install_promtool || echo ".ci/run: promtool could not be installed: its tests will skip" >&2'
    # -q only quiets pip's progress; then the README's command, the real tier as docs/testing.md
    # runs it (its environment built first), then the operator's install.
    real = ".venv/bin/python -m pytest tests/real_vllm"
    assert real.removeprefix(".venv/bin/") in (ROOT / "docs" / "testing.md").read_text()
    assert calls[1:] == [command.replace("pip install -e", "pip install -q -e"),
                         ".venv/bin/python -m tests.real_vllm.environment", real, "check_wheel"]
