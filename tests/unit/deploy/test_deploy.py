"""The files in ``deploy/`` parse, fit together, and name only metrics the code defines.

Why: deployment files rot silently — a renamed metric leaves a dashboard panel empty and an
alert that can never fire, a graceful timeout raised in the settings but not in systemd or
Kubernetes turns graceful stops into SIGKILLs. These tests tie every such value to its source.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from narwhal.settings import Settings, SettingsError, load_settings
from tests.unit.deploy.deploy_support import (
    ALERTS,
    DASHBOARD,
    DEPLOY,
    JOB,
    K8S,
    ROOT,
    UNIT,
    kustomized,
    manifests,
    operator_docs,
)

# docs/operations.md "Following a request", plus the supervisor's restart counter the alerts need.
SPEC_FAMILIES = [
    "narwhal_requests_total", "narwhal_ttft_seconds", "narwhal_first_byte_seconds",
    "narwhal_handoff_age_seconds", "narwhal_attempts_total", "narwhal_retries_total",
    "narwhal_retry_budget_exhausted_total", "narwhal_engine_failures_total", "narwhal_engine_state",
    "narwhal_engine_inflight", "narwhal_probes_total", "narwhal_handoffs_released_total",
    "narwhal_handoffs_abandoned_total", "narwhal_stream_aborted_total", "narwhal_client_disconnects_total",
    "narwhal_supervisor_restarts_total", "narwhal_local_decodes_total", "narwhal_prefill_tokens_total",
    "narwhal_placements_total",
]
SETTINGS_SECTIONS = {
    "server", "request", "engine", "handoff", "placement", "preflight", "log", "recovery",
    "discovery", "engine_contract", "engines",
}

# ----------------------------------------------------------------------------- metric names

_NAME = re.compile(r"(?<![A-Za-z0-9_:])narwhal_[a-z0-9_]*[a-z0-9]")
_CONSTRUCTED = re.compile(
    r"\b(Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*(?:name\s*=\s*)?[\"'](narwhal_[a-z0-9_]+)[\"']"
)
_LITERAL = re.compile(r"[\"'](narwhal_[a-z0-9_]+)[\"']")


def defined_series() -> tuple[set[str], set[str]]:
    """(series names Prometheus exposes, family names) for the metrics in narwhal/metrics.py.

    prometheus_client appends ``_total`` to counters (stripping one given in the name) and exposes
    ``_bucket``/``_count``/``_sum`` for histograms — a PromQL query must name those, never the
    bare histogram name. A name whose constructor is not recognised is taken literally.
    """
    source = (ROOT / "narwhal" / "metrics.py").read_text()
    kinds = {name: kind for kind, name in _CONSTRUCTED.findall(source)}
    series: set[str] = set()
    families: set[str] = set()
    for name in set(_LITERAL.findall(source)):
        kind = kinds.get(name)
        if kind == "Counter":
            base = name.removesuffix("_total")
            series |= {f"{base}_total", f"{base}_created"}
            families |= {base, f"{base}_total"}
        elif kind in ("Histogram", "Summary"):
            series |= {f"{name}_count", f"{name}_sum", f"{name}_created"}
            series |= {f"{name}_bucket"} if kind == "Histogram" else {name}
            families.add(name)
        elif kind == "Info":
            series.add(f"{name}_info")
            families.add(name)
        else:
            series.add(name)
            families.add(name)
    return series, families


def _expressions() -> list[str]:
    """Every PromQL expression in deploy/: alert and recording rules, dashboard panels and variables."""
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    exprs = [r["expr"] for r in rules]
    exprs += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def _deploy_texts() -> list[str]:
    return [p.read_text() for p in sorted(DEPLOY.rglob("*")) if p.is_file()]


# Queries must name exposed series (``_bucket``, ``_total``); prose (annotations, descriptions,
# comments, the README) may also name a metric family (``narwhal_ttft_seconds``).
QUERY_NAMES = sorted({n for e in _expressions() for n in _NAME.findall(e)})
PROSE_NAMES = sorted({n for t in _deploy_texts() for n in _NAME.findall(t)} - set(QUERY_NAMES))


def test_the_deploy_files_need_exactly_these_metrics() -> None:
    assert QUERY_NAMES == [
        "narwhal_attempts_total",
        "narwhal_build_info",
        "narwhal_client_disconnects_total",
        "narwhal_engine_failures_total",
        "narwhal_engine_inflight",
        "narwhal_engine_state",
        "narwhal_first_byte_seconds_bucket",
        "narwhal_handoff_age_seconds_bucket",
        "narwhal_handoffs_abandoned_total",
        "narwhal_handoffs_released_total",
        "narwhal_holdings_predictions_total",
        "narwhal_inter_token_seconds_bucket",
        "narwhal_local_decodes_total",
        "narwhal_placements_total",
        "narwhal_prefill_tokens_total",
        "narwhal_probes_total",
        "narwhal_requests_inflight",
        "narwhal_requests_queued",
        "narwhal_requests_total",
        "narwhal_retries_total",
        "narwhal_retry_budget_exhausted_total",
        "narwhal_stream_aborted_total",
        "narwhal_supervisor_restarts_total",
        "narwhal_ttft_seconds_bucket",
    ]


@pytest.mark.parametrize("name", QUERY_NAMES)
def test_every_queried_metric_is_defined_in_the_code(name: str) -> None:
    series, _ = defined_series()
    assert name in series, f"{name} is queried in deploy/ but narwhal/metrics.py does not expose it"


@pytest.mark.parametrize("name", PROSE_NAMES)
def test_every_metric_named_in_prose_is_defined_in_the_code(name: str) -> None:
    series, families = defined_series()
    assert name in series | families


def test_the_name_rules_are_the_client_libraries() -> None:
    # A self-check of defined_series() against prometheus_client's own exposition.
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    registry = CollectorRegistry()
    Counter("narwhal_x_total", "x", registry=registry).inc()
    Counter("narwhal_y", "y", registry=registry).inc()
    Histogram("narwhal_z_seconds", "z", registry=registry).observe(1)
    text = generate_latest(registry).decode()
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert exposed == {
        "narwhal_x_total", "narwhal_x_created", "narwhal_y_total", "narwhal_y_created",
        "narwhal_z_seconds_bucket", "narwhal_z_seconds_count", "narwhal_z_seconds_sum", "narwhal_z_seconds_created",
    }


# ----------------------------------------------------------------------------- Grafana


def test_the_dashboard_covers_every_spec_metric() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "narwhal-router"
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    text = "\n".join(exprs)
    missing = [f for f in SPEC_FAMILIES if not re.search(rf"\b{f}(_bucket)?\b", text)]
    assert missing == []
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and all(t["expr"].count("(") == t["expr"].count(")") for t in panel["targets"])
        assert all('job="$job", instance=~"$instance"' in t["expr"] for t in panel["targets"])
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "job", "instance"]


def test_the_dashboard_shows_the_series_beyond_the_spec_and_its_panels_do_not_overlap() -> None:
    # These four had no panel.
    dash = json.loads(DASHBOARD.read_text())
    text = "\n".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for family in ("narwhal_inter_token_seconds_bucket", "narwhal_requests_inflight", "narwhal_requests_queued",
                   "narwhal_build_info"):
        assert re.search(rf"\b{family}\{{", text), family
    cells: dict[tuple[int, int], int] = {}
    for panel in dash["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {panel['id']} overlap"
                cells[(x, y)] = panel["id"]


# ----------------------------------------------------------------------------- Prometheus


def test_alert_rules() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for group in doc["groups"] for r in group["rules"]]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert sorted(alerts) == [
        "NarwhalEngineEjected", "NarwhalFirstByteP99High", "NarwhalHandoffsAbandoned", "NarwhalHigh5xxRatio",
        "NarwhalRetryBudgetExhausted", "NarwhalRoleBelowCapacity", "NarwhalRoleDown", "NarwhalRouterAbsent",
        "NarwhalRouterDown", "NarwhalSupervisorRestarts",
    ]
    assert alerts["NarwhalRouterDown"]["expr"] == f'up{{job="{JOB}"}} == 0'
    assert alerts["NarwhalRouterAbsent"]["expr"] == f'absent(up{{job="{JOB}"}})'
    for rule in alerts.values():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
    # Per replica, so the alert says which instance is slow.
    assert alerts["NarwhalFirstByteP99High"]["expr"].startswith(
        "histogram_quantile(0.99, sum by (job, instance, le) (rate(narwhal_first_byte_seconds_bucket[5m])))"
    )
    assert "{{ $labels.instance }}" in alerts["NarwhalFirstByteP99High"]["annotations"]["summary"]
    assert 'narwhal_requests_total{code=~"5.."}' in alerts["NarwhalHigh5xxRatio"]["expr"]
    assert alerts["NarwhalEngineEjected"]["expr"] == "narwhal:engine_state:max == 2"
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert records["narwhal:engine_state:max"] == "max by (job, instance, engine, role) (narwhal_engine_state)"
    used = " ".join(r["expr"] for r in rules)
    assert all(name in used for name in records)


def test_scrape_config() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())
    (job,) = doc["scrape_configs"]
    assert (job["job_name"], job["metrics_path"]) == ("narwhal", "/metrics")
    assert doc["rule_files"] == ["/etc/prometheus/rules/narwhal-alerts.yml"]


# ----------------------------------------------------------------------------- settings


def _load_toml_text(text: str, tmp_path: Path) -> Settings:
    path = tmp_path / "narwhal.toml"
    path.write_text(text)
    return load_settings(str(path), environ={})


def test_the_example_settings_load_and_have_every_section(tmp_path: Path) -> None:
    text = (DEPLOY / "narwhal.toml").read_text()
    assert set(tomllib.loads(text)) == SETTINGS_SECTIONS
    settings = _load_toml_text(text, tmp_path)
    roles = [e.role for e in settings.engines]
    assert roles == ["producer", "producer", "consumer", "consumer", "consumer"]
    assert settings.engine_contract is not None and settings.engine_contract.model
    assert settings.handoff.max_age_s > settings.engine.prefill_timeout_s
    section_lines = [line for line in text.splitlines()  # [placement.held] is a table within [placement]
                     if line.startswith("[") and "]]" not in line and "." not in line.split("]")[0]]
    assert len(section_lines) == len(SETTINGS_SECTIONS) - 1


def test_production_settings_bound_quarantine_and_ejections(tmp_path: Path) -> None:
    # A storm of requests every engine fails on must not empty a role. The example
    # settings, the Kubernetes ConfigMap and the README's production guidance say the same.
    configmap = manifests()["ConfigMap"]["data"]["narwhal.toml"]
    for text in ((DEPLOY / "narwhal.toml").read_text(), configmap):
        recovery = _load_toml_text(text, tmp_path).recovery
        assert (recovery.failure_quarantine_s, recovery.max_ejected_fraction, recovery.max_retries) == (1.0, 0.5, 1)
    readme = operator_docs()
    assert "`failure_quarantine_s = 1` and `max_ejected_fraction = 0.5`" in readme
    assert "Envoy's outlier detection ejects at most 10 %" in readme


# ----------------------------------------------------------------------------- systemd


def _unit() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


def test_systemd_unit_directives(tmp_path: Path) -> None:
    unit = _unit()
    graceful = _load_toml_text((DEPLOY / "narwhal.toml").read_text(), tmp_path).server.graceful_timeout_s
    assert unit["ExecStart"] == ["/opt/narwhal/venv/bin/narwhal serve --config /etc/narwhal/narwhal.toml"]
    # gunicorn's master (the exec'd main pid) sends READY=1 after the preflight and the bind.
    assert (unit["Type"], unit["NotifyAccess"], unit["TimeoutStartSec"]) == (["notify"], ["main"], ["120"])
    assert unit["EnvironmentFile"] == ["-/etc/narwhal/narwhal.env"]
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert (unit["Restart"], unit["LimitNOFILE"], unit["KillSignal"]) == (["on-failure"], ["1048576"], ["SIGTERM"])
    assert unit["KillMode"] == ["mixed"]  # SIGTERM to the master only: gunicorn orchestrates the stop
    assert graceful < int(unit["TimeoutStopSec"][0]) <= graceful + 10
    assert unit["User"] == ["narwhal"]
    assert (unit["NoNewPrivileges"], unit["ProtectSystem"], unit["PrivateTmp"]) == (["yes"], ["strict"], ["yes"])
    # The multiprocess directory must be writable under ProtectSystem=strict: /run/<RuntimeDirectory>.
    assert unit["RuntimeDirectory"] == ["narwhal"]
    assert unit["Environment"] == ["PROMETHEUS_MULTIPROC_DIR=/run/narwhal/metrics"]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this checkout's entry point.
    binary = Path(sys.executable).parent / "narwhal"
    exe = str(binary) if binary.exists() else shutil.which("true") or "/bin/true"
    unit = tmp_path / "narwhal.service"
    unit.write_text(UNIT.read_text().replace("/opt/narwhal/venv/bin/narwhal", exe))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert [line for line in output.splitlines() if "narwhal.service" in line] == []


# ----------------------------------------------------------------------------- Kubernetes


def test_kubernetes_manifests_fit_together(tmp_path: Path) -> None:
    docs = manifests()
    assert sorted(docs) == [
        "ConfigMap", "Deployment", "Kustomization", "PodDisruptionBudget", "PodMonitor", "PrometheusRule", "Role",
        "RoleBinding", "Service", "ServiceAccount",
    ]
    assert docs["PodMonitor"]["apiVersion"] == "monitoring.coreos.com/v1"
    deploy, config = docs["Deployment"], docs["ConfigMap"]
    pod = deploy["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"] == labels
    assert deploy["spec"]["replicas"] >= 2
    for kind in ("Service", "PodDisruptionBudget"):
        selector = docs[kind]["spec"]["selector"]
        assert selector.get("matchLabels", selector) == labels
    assert docs["PodMonitor"]["spec"]["selector"]["matchLabels"] == labels
    (container,) = pod["spec"]["containers"]
    assert pod["spec"]["enableServiceLinks"] is False  # see test_service_links_would_stop_the_router
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    assert docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    assert container["args"] == ["serve", "--config", "/etc/narwhal/narwhal.toml"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/narwhal")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    assert set(config["data"]) == {"narwhal.toml"}
    settings = _load_toml_text(config["data"]["narwhal.toml"], tmp_path)
    assert settings.server.bind == "0.0.0.0:8700"
    assert int(settings.server.bind.rsplit(":", 1)[1]) == container["ports"][0]["containerPort"]
    assert settings.server.workers == int(container["resources"]["requests"]["cpu"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + settings.server.graceful_timeout_s
    resources = docs["Kustomization"]["resources"]
    assert sorted(resources) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_kustomize_builds() -> None:
    kinds = sorted(doc["kind"] for doc in kustomized(K8S))
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "PodMonitor", "PrometheusRule", "Role",
                     "RoleBinding", "Service", "ServiceAccount"]


def test_the_api_discovery_overlay_watches_the_engines_services_with_exactly_its_role(tmp_path: Path) -> None:
    """deploy/kubernetes-discovery: 2 replicas whose settings (the ConfigMap's, with the overlay's
    variables) find the engines from the EndpointSlices of the engines' Services, as the
    ServiceAccount whose Role allows list and watch of EndpointSlices in the namespace alone."""
    docs = {doc["kind"]: doc for doc in kustomized(K8S.parent / "kubernetes-discovery")}
    deploy, config = docs["Deployment"], docs["ConfigMap"]
    pod = deploy["spec"]["template"]["spec"]
    assert deploy["spec"]["replicas"] == 2
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e and e["name"].startswith(
        "NARWHAL_DISCOVERY")}
    path = tmp_path / "narwhal.toml"
    path.write_text(config["data"]["narwhal.toml"])
    settings = load_settings(str(path), environ=env)
    kube = settings.discovery.kubernetes
    assert settings.discovery.dns == [] and kube is not None and kube.namespace == deploy["metadata"]["namespace"]
    engines = [doc for p in sorted((K8S / "engines").glob("vllm-*.yaml")) for doc in yaml.safe_load_all(p.read_text())]
    services = {d["metadata"]["name"]: d for d in engines if d["kind"] == "Service"}
    for role, selector in kube.selectors():
        service = services[selector.removeprefix("kubernetes.io/service-name=")]
        assert kube.port_name in [p["name"] for p in service["spec"]["ports"]], role
    (rule,) = docs["Role"]["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}
    binding = docs["RoleBinding"]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "narwhal", "namespace": "llm"}]


def test_service_links_would_stop_the_router() -> None:
    # What Kubernetes puts into every pod of the namespace for the `narwhal` Service when
    # enableServiceLinks is left on: the router refuses to start on the first of them.
    service = manifests()["Service"]
    name = service["metadata"]["name"].upper()
    links = {f"{name}_SERVICE_HOST": "10.96.0.10", f"{name}_SERVICE_PORT": str(service["spec"]["ports"][0]["port"]),
             f"{name}_PORT": "tcp://10.96.0.10:80"}
    with pytest.raises(SettingsError, match=f"^{name}_SERVICE_HOST: unknown setting$"):
        load_settings(None, environ=links)


# The Kubernetes release whose API schemas the manifests are checked against (kubernetes-validate
# bundles them: no cluster, no network). The Prometheus Operator's kinds are CRDs it has no
# schema for; their fields are checked by the tests above.
KUBERNETES_VERSION = "1.33"
OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object in deploy/kubernetes*/, as written, with its file."""
    found = []
    for path in sorted(K8S.parent.glob("kubernetes*/**/*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") not in (None, "Kustomization"):
                found.append((path.relative_to(K8S.parent).as_posix(), doc))
    return found


def test_the_manifests_match_the_kubernetes_api_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = []
    for name, doc in _manifests():
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", name
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises, naming the field
        checked.append(doc["kind"])
    assert sorted(set(checked)) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding",
                                    "Service", "ServiceAccount", "StatefulSet"]


def test_the_schema_check_refuses_a_field_the_api_does_not_have() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = next(doc for name, doc in _manifests() if doc["kind"] == "Deployment")
    wrong = json.loads(json.dumps(deployment))
    wrong["spec"]["replica"] = 2  # a typo kubectl apply would refuse
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)
    wrong = json.loads(json.dumps(deployment))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("folder", ["kubernetes", "kubernetes-discovery"])
def test_what_kustomize_builds_matches_the_schemas(folder: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in kustomized(K8S.parent / folder):  # skipped without kubectl
        if doc["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
