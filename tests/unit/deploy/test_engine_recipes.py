"""The engine recipes start exactly the fleet the settings name, with flags vLLM 0.33.0 has.

Why: a ``vllm serve`` line that disagrees with ``deploy/narwhal.toml`` or the Kubernetes
ConfigMap (another port, two engines on one side-channel port, a TP size without the GPUs for
it, a consumer whose TP is no multiple of its producers', another connector) fails only on GPU
hosts, at the first KV transfer. These tests read every recipe — each ``sh`` block of docs/deploy.md with
``vllm serve`` lines, and ``deploy/kubernetes/engines/`` — check it against its settings, and
check every flag and variable against the ones read in vLLM 0.33.0's sources (the version the
settings pin): ``vllm/engine/arg_utils.py``, ``vllm/entrypoints/common/cli_args.py``,
``vllm/config/kv_transfer.py``, ``vllm/envs.py`` and ``.../kv_connector/v1/nixl/base_scheduler.py``.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from narwhal.engines.control import VersionPin
from narwhal.fleet import Fleet
from narwhal.settings import Settings, load_settings
from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.discovery.wanted import engine_name
from tests.unit.deploy.deploy_support import DEPLOY_GUIDE, K8S, ROOT, kustomized

ENGINES = K8S / "engines"
VLLM = "0.33.0"

# Read in vLLM 0.33.0: arg_utils.py (--tensor-parallel-size, --max-num-seqs, --enable-prefix-caching,
# --kv-transfer-config) and entrypoints/common/cli_args.py (--port, --enable-prompt-tokens-details,
# --enable-scale-out).
VERIFIED_FLAGS = {
    "--port", "--tensor-parallel-size", "--max-num-seqs", "--enable-prefix-caching",
    "--enable-prompt-tokens-details", "--kv-transfer-config", "--enable-scale-out",
}
BOOLEAN_FLAGS = {"--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-scale-out"}
# KVTransferConfig.kv_load_failure_policy ("fail" | "recompute"), and the lease NIXL's scheduler reads
# from kv_connector_extra_config (nixl/base_scheduler.py, default 30 s): it must equal handoff.lease_s.
KV_EXTRA_KEYS = {"kv_load_failure_policy", "kv_connector_extra_config"}
# envs.py and nixl_connector.py (VLLM_NIXL_*); UCX_NET_DEVICES is UCX's, from vLLM's 0.11.0 guide.
VERIFIED_ENV = {"CUDA_VISIBLE_DEVICES", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "UCX_NET_DEVICES"}
KV_ROLES = {"kv_producer", "kv_consumer", "kv_both"}  # config/kv_transfer.py, KVRole


@dataclass(frozen=True)
class Command:
    env: dict[str, str]
    model: str
    flags: dict[str, str | None]

    def flag(self, name: str) -> str:
        value = self.flags[name]
        assert value is not None, name
        return value


def parse_serve(argv: list[str], env: dict[str, str]) -> Command:
    """``[model, --flag, value, --bool-flag, ...]`` (what follows ``vllm serve``)."""
    model, rest = argv[0], argv[1:]
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(rest):
        name = rest[i]
        assert name.startswith("--") and name not in flags, name
        if name in BOOLEAN_FLAGS:
            flags[name] = None
            i += 1
        else:
            flags[name] = rest[i + 1]
            i += 2
    return Command(env, model, flags)


def _serve_lines(block: str) -> list[Command]:
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if "vllm serve " not in line:
            continue
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
        rest = words[len(env):]
        assert rest[:2] == ["vllm", "serve"], line
        commands.append(parse_serve(rest[2:], env))
    return commands


def readme_recipes() -> list[list[Command]]:
    """Every ``sh`` block of the deployment guide that starts engines: its ``vllm serve`` lines."""
    blocks = DEPLOY_GUIDE.read_text().split("```sh\n")[1:]
    return [c for c in (_serve_lines(b.split("```", 1)[0]) for b in blocks) if c]


def readme_commands() -> list[Command]:
    """The bare-metal recipe of "Real engines": the engines of ``deploy/narwhal.toml``."""
    text = DEPLOY_GUIDE.read_text()
    section = text.split("## Real engines", 1)[1].split("\n## ", 1)[0]
    commands = _serve_lines(section.split("```sh\n", 1)[1].split("```", 1)[0])
    assert commands in readme_recipes()
    return commands


def _settings(text: str, tmp_path: Path) -> Settings:
    path = tmp_path / "narwhal.toml"
    path.write_text(text)
    return load_settings(str(path), environ={})


ROLE_OF = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}  # kv_both: deprecated


def _check_engine_flags(command: Command, settings: Settings, consumer_streams: int | None,
                        role: str = "producer") -> None:
    contract = settings.engine_contract
    assert contract is not None
    assert set(command.flags) <= VERIFIED_FLAGS
    assert command.model == contract.model
    kv = json.loads(command.flag("--kv-transfer-config"))
    assert {k: kv[k] for k in ("kv_connector", "kv_role")} == {"kv_connector": contract.kv_connector,
                                                              "kv_role": ROLE_OF[role]} and kv["kv_role"] in KV_ROLES
    assert set(kv) - {"kv_connector", "kv_role"} <= KV_EXTRA_KEYS
    assert kv["kv_load_failure_policy"] in ("fail", "recompute")
    assert kv["kv_connector_extra_config"]["kv_lease_duration"] == settings.handoff.lease_s
    assert command.flags["--enable-prefix-caching"] is None and command.flags["--enable-prompt-tokens-details"] is None
    if consumer_streams is not None:
        assert int(command.flag("--max-num-seqs")) >= consumer_streams
    else:
        assert "--max-num-seqs" not in command.flags


def test_the_readme_starts_exactly_the_engines_of_the_example_settings(tmp_path: Path) -> None:
    settings = _settings((ROOT / "deploy" / "narwhal.toml").read_text(), tmp_path)
    commands = readme_commands()
    assert len(commands) == len(settings.engines) == 5
    for engine in settings.engines:
        url = urlsplit(engine.url)
        (command,) = [c for c in commands if int(c.flag("--port")) == url.port]
        assert set(command.env) == VERIFIED_ENV
        assert command.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == url.hostname  # never localhost across hosts
        gpus = command.env["CUDA_VISIBLE_DEVICES"].split(",")
        assert int(command.flag("--tensor-parallel-size")) == len(gpus)
        streams = engine.max_inflight_decode if engine.role == "consumer" else None
        _check_engine_flags(command, settings, streams, engine.role)


def test_engines_on_one_host_share_no_gpu_and_no_port(tmp_path: Path) -> None:
    settings = _settings((ROOT / "deploy" / "narwhal.toml").read_text(), tmp_path)
    router_port = int(settings.server.bind.rsplit(":", 1)[1])
    commands = readme_commands()
    assert {c.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for c in commands} == {"10.0.0.5"}
    gpus = [g for c in commands for g in c.env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert sorted(gpus) == [str(i) for i in range(8)]
    http = [int(c.flag("--port")) for c in commands]
    # 0.11: each TP rank listens on base + rank (an engine holds tensor-parallel-size ports);
    # 0.2x on, one port per engine. The recipe's ranges serve both.
    side = [int(c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + rank
            for c in commands for rank in range(int(c.flag("--tensor-parallel-size")))]
    assert side == list(range(5600, 5608))
    assert len(set(http)) == len(http) and router_port not in http and not set(http) & set(side)


def test_the_pinned_engine_version_is_the_one_the_recipes_were_checked_against(tmp_path: Path) -> None:
    config = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["narwhal.toml"]
    for text in ((ROOT / "deploy" / "narwhal.toml").read_text(), config):
        contract = _settings(text, tmp_path).engine_contract
        assert contract is not None and VersionPin.of(contract) is not None
        assert VersionPin(contract.engine_version).matches(VLLM)  # exact or a range, as the router reads it
        assert VersionPin(contract.engine_version).matches("0.34.0")  # the newest release is admitted
    assert f"checked against **vLLM {VLLM}**" in DEPLOY_GUIDE.read_text()


# ----------------------------------------------------------------------------- Kubernetes


def _engine_docs() -> dict[tuple[str, str], dict[str, Any]]:
    docs = {}
    for name in yaml.safe_load((ENGINES / "kustomization.yaml").read_text())["resources"]:
        for doc in yaml.safe_load_all((ENGINES / name).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container


def test_the_kubernetes_engines_are_found_through_their_headless_services(tmp_path: Path) -> None:
    """The ConfigMap names no engine: each ``[[discovery.dns]]`` name is an engine StatefulSet's
    headless Service, on its pods' port, with the role its pods serve (docs/behaviour.md "Engines that come and go")."""
    settings = _settings(yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["narwhal.toml"], tmp_path)
    replicas = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["replicas"]
    docs = _engine_docs()
    assert sorted(docs) == [("Service", "vllm-decode"), ("Service", "vllm-prefill"),
                            ("StatefulSet", "vllm-decode"), ("StatefulSet", "vllm-prefill")]
    assert settings.engines == [] and settings.discovery.enabled and not settings.discovery.file
    found = set()
    for source in settings.discovery.dns:
        service, namespace, *domain = source.name.split(".")
        assert (namespace, domain) == ("llm", ["svc", "cluster", "local"])
        assert (docs[("Service", service)]["spec"]["clusterIP"], source.srv, source.scheme) == ("None", False, "http")
        statefulset = docs[("StatefulSet", service)]
        assert statefulset["spec"]["serviceName"] == service
        assert statefulset["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == (
            "prefill" if source.role == "producer" else "decode")
        container = _container(statefulset)
        assert source.port == container["ports"][0]["containerPort"] == 8000
        assert container["ports"][0]["name"] == "http"
        found.add(service)
        streams = source.max_inflight_decode * replicas if source.role == "consumer" and source.max_inflight_decode \
            else None
        assert container["command"] == ["vllm", "serve"]
        command = parse_serve(container["args"], {})
        assert int(command.flag("--port")) == source.port
        _check_engine_flags(command, settings, streams, source.role)
    assert found == {name for kind, name in docs if kind == "StatefulSet"}  # every engine StatefulSet is found


@pytest.mark.parametrize("name", ["vllm-prefill", "vllm-decode"])
def test_each_engine_pod_has_its_gpus_side_channel_and_no_service_links(name: str) -> None:
    docs = _engine_docs()
    statefulset, service = docs[("StatefulSet", name)], docs[("Service", name)]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert statefulset["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    assert (service["spec"]["clusterIP"], service["spec"]["publishNotReadyAddresses"]) == ("None", True)
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    container = _container(statefulset)
    assert container["image"] == f"vllm/vllm-openai:v{VLLM}"
    tp = int(parse_serve(container["args"], {}).flag("--tensor-parallel-size"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
    env = {e["name"]: e for e in container["env"]}
    assert set(env) == VERIFIED_ENV - {"CUDA_VISIBLE_DEVICES"} | {"HF_TOKEN"}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    base = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    nixl = [(p["name"], p["containerPort"]) for p in container["ports"][1:]]
    assert nixl == [(f"nixl-{rank}", base + rank) for rank in range(tp)]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_kustomize_builds_the_engines() -> None:
    built = sorted((d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in kustomized(ENGINES))
    assert built == [("Service", "vllm-decode", "llm"), ("Service", "vllm-prefill", "llm"),
                     ("StatefulSet", "vllm-decode", "llm"), ("StatefulSet", "vllm-prefill", "llm")]


# ----------------------------------------------------------------------------- every recipe


@dataclass(frozen=True)
class Run:
    """One engine as a recipe starts it: where it listens and with what tensor parallelism."""

    host: str  # the side channel's host (a pod on Kubernetes: each has its own IP)
    http_port: int
    side_base: int  # VLLM_NIXL_SIDE_CHANNEL_PORT
    tp: int

    @property
    def ports(self) -> set[int]:
        # vLLM 0.11.0: each TP rank's handshake listener binds base + rank (nixl_connector.py).
        return {self.http_port} | {self.side_base + rank for rank in range(self.tp)}


def _bare_metal(tmp_path: Path) -> tuple[Settings, dict[str, Run]]:
    settings = _settings((ROOT / "deploy" / "narwhal.toml").read_text(), tmp_path)
    by_port = {int(c.flag("--port")): c for c in readme_commands()}
    runs = {}
    for engine in settings.engines:
        c = by_port[urlsplit(engine.url).port or 0]
        runs[engine.name] = Run(c.env["VLLM_NIXL_SIDE_CHANNEL_HOST"], int(c.flag("--port")),
                                int(c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]), int(c.flag("--tensor-parallel-size")))
    return settings, runs


def _kubernetes(tmp_path: Path) -> tuple[Settings, dict[str, Run]]:
    """The engines discovery finds: every pod of each ``[[discovery.dns]]`` name's StatefulSet."""
    settings = _settings(yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["narwhal.toml"], tmp_path)
    docs = _engine_docs()
    runs = {}
    engines = []
    for source in settings.discovery.dns:
        service = source.name.split(".")[0]
        statefulset = docs[("StatefulSet", service)]
        container = _container(statefulset)
        command = parse_serve(container["args"], {})
        env = {e["name"]: e.get("value") for e in container["env"]}
        for i in range(statefulset["spec"]["replicas"]):
            pod = f"{service}-{i}"
            url = f"http://{pod}.{source.name}:{source.port}"
            engines.append(EngineSpec(name=engine_name(source.role, url), url=url, role=source.role))
            runs[engines[-1].name] = Run(pod, int(command.flag("--port")), int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
                                         int(command.flag("--tensor-parallel-size")))
    return settings.model_copy(update={"engines": engines}), runs


RECIPES = {"README bare metal": _bare_metal, "deploy/kubernetes/engines": _kubernetes}


def test_every_readme_recipe_is_checked() -> None:
    # A second recipe in docs/deploy.md would need its own settings here, or it goes unchecked.
    assert readme_recipes() == [readme_commands()]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_permitted_pair_has_tensor_parallel_sizes_vllm_accepts(recipe: str, tmp_path: Path) -> None:
    # vLLM 0.11's NixlConnector (ai-dynamo/dynamo#2295): each consumer rank reads one producer
    # rank's share of the KV heads, so the consumer's TP is a multiple of the producer's.
    settings, runs = RECIPES[recipe](tmp_path)
    pairs = [(p.name, d.name) for p in Fleet(settings).engines for d in p.permitted_consumers if d is not p]
    assert pairs
    refused = [(p, runs[p].tp, d, runs[d].tp) for p, d in pairs if runs[d].tp % runs[p].tp != 0]
    assert refused == []


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_engines_sharing_a_host_use_disjoint_http_and_side_channel_ports(recipe: str, tmp_path: Path) -> None:
    settings, runs = RECIPES[recipe](tmp_path)
    router = int(settings.server.bind.rsplit(":", 1)[1])
    taken: dict[tuple[str, int], str] = {}
    for name, run in runs.items():
        for port in run.ports:
            assert (run.host, port) not in taken, f"{name} and {taken[(run.host, port)]} both use {run.host}:{port}"
            taken[(run.host, port)] = name
    if recipe == "README bare metal":  # the router runs on the engines' host
        assert all((host, router) not in taken for host in {r.host for r in runs.values()})


def test_the_routers_default_port_is_no_engines(tmp_path: Path) -> None:
    # 127.0.0.1:8000 was vLLM's own default port on a shared host.
    from narwhal.demo import DEFAULT_PORT
    from narwhal.settings import ServerSettings

    port = int(ServerSettings().bind.rsplit(":", 1)[1])
    engine_ports = {run_port for recipe in RECIPES.values() for run in recipe(tmp_path)[1].values()
                    for run_port in run.ports}
    # vLLM's, Triton's and Ray Serve's 8000, SGLang's 30000, TGI's 3000 and 8080 (the demo's).
    assert port not in engine_ports | {8000, 30000, 3000, 8080, DEFAULT_PORT}
