"""Where the deploy files are, for every test of ``deploy/``: paths, the Prometheus job, the
Kubernetes manifests by kind, and what ``kubectl kustomize`` builds of a folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
DEPLOY_GUIDE = ROOT / "docs" / "deploy.md"  # the real-engine recipe and production guidance


def operator_docs() -> str:
    """What an operator reads: the README and the guides in ``docs/`` (the README
    keeps the essentials and points at the guides), as one text."""
    return "\n".join(p.read_text() for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))))
UNIT = DEPLOY / "systemd" / "narwhal.service"
DASHBOARD = DEPLOY / "grafana" / "narwhal-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
JOB = "narwhal"
K8S = DEPLOY / "kubernetes"


def manifests() -> dict[str, dict[str, Any]]:
    """Every document of ``deploy/kubernetes/*.yaml``, by its ``kind``."""
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def kustomized(folder: Path) -> list[Any]:
    """The documents ``kubectl kustomize folder`` builds; the test is skipped without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    proc = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return list(yaml.safe_load_all(proc.stdout))
