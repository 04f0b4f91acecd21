"""The ``Dockerfile`` builds the image the Kubernetes Deployment names, and runs it as that pod would.

Where a container engine answers (``docker info`` or ``podman info``), the image is built and
run. Where none does (CI machines without a daemon), the build test says so and skips; the
Dockerfile is still checked on every machine: by a structural lint here, which ties its values
to ``pyproject.toml`` and ``deploy/kubernetes/deployment.yaml``, and by hadolint (a test
dependency) for the generic rules.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.deploy_support import operator_docs

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PYPROJECT["version"]
IMAGE = f"ghcr.io/narwhal-router/narwhal:{VERSION}"
BASE = "python:3.11-slim-bookworm"


def instructions(text: str) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]``: continuation lines joined, comments and blank lines dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        result.append((keyword.upper(), " ".join(args.split())))
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, args in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            found.append([])
        assert found, "an instruction before the first FROM"
        found[-1].append((keyword, args))
    return found


def _one(stage: list[tuple[str, str]], keyword: str) -> str:
    values = [args for kw, args in stage if kw == keyword]
    assert len(values) == 1, f"{keyword}: {values}"
    return values[0]


def _router_container() -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def test_the_dockerfile_has_a_build_stage_and_a_slim_runtime_stage() -> None:
    build, final = stages()
    assert build[0] == ("FROM", f"{BASE} AS build")
    assert final[0] == ("FROM", BASE)
    # The base's Python is the oldest the package supports.
    assert PYPROJECT["requires-python"] == ">=3.11"
    assert [args for kw, args in build if kw == "COPY"] == ["pyproject.toml README.md LICENSE ./", "narwhal ./narwhal"]
    # The tracing extra too: [tracing] enabled = true works in the image.
    assert _one(build, "RUN") == "pip wheel --no-cache-dir --wheel-dir /wheels '.[tracing]'"
    assert all(kw != "ADD" for stage in (build, final) for kw, _ in stage)


def test_the_runtime_stage_installs_only_the_built_wheels_and_runs_as_the_pods_user() -> None:
    _, final = stages()
    run = _one(final, "RUN")
    assert run.startswith(
        "pip install --no-cache-dir --no-index --find-links /wheels 'narwhal-router[tracing]' && rm -rf /wheels")
    assert "useradd --system --uid 10001 --gid 10001" in run and "groupadd --system --gid 10001 narwhal" in run
    assert [args for kw, args in final if kw == "COPY"] == [
        "--from=build /wheels /wheels", "gunicorn.conf.py ./gunicorn.conf.py",
    ]
    pod, container = _router_container()
    security = pod["securityContext"]
    assert _one(final, "USER") == f"{security['runAsUser']}:{security['runAsGroup']}" == "10001:10001"
    # The user is set after everything that needs root.
    assert [kw for kw, _ in final].index("USER") > [kw for kw, _ in final].index("RUN")


def test_the_entry_point_and_port_are_the_deployments() -> None:
    _, final = stages()
    _, container = _router_container()
    assert json.loads(_one(final, "ENTRYPOINT")) == container["command"] == ["narwhal"]
    assert json.loads(_one(final, "CMD")) == container["args"] == ["serve", "--config", "/etc/narwhal/narwhal.toml"]
    port = container["ports"][0]["containerPort"]
    assert _one(final, "EXPOSE") == str(port) == "8700"
    # All interfaces: the settings' 127.0.0.1 is unreachable from outside.
    env = shlex.split(_one(final, "ENV"))
    assert f"NARWHAL_SERVER__BIND=0.0.0.0:{port}" in env
    assert _one(final, "STOPSIGNAL") == "SIGTERM"
    healthcheck = _one(final, "HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert shlex.split(options) == ["--interval=10s", "--timeout=5s", "--start-period=120s", "--retries=3"]
    assert json.loads(command) == [
        "python", "-c",
        "import os, urllib.request; port = os.environ['NARWHAL_SERVER__BIND'].rpartition(':')[2]; "
        "urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=4)",
    ]


def test_the_healthcheck_asks_the_port_the_image_binds(tmp_path: Path) -> None:
    # The HEALTHCHECK's own command, run against a server on the port NARWHAL_SERVER__BIND names.
    import functools
    import http.server
    import threading

    _, final = stages()
    check = json.loads(_one(final, "HEALTHCHECK").partition(" CMD ")[2])
    (tmp_path / "health").write_text("")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"NARWHAL_SERVER__BIND": f"0.0.0.0:{server.server_address[1]}", "PATH": "/usr/bin:/bin"}
        ok = subprocess.run([sys.executable, *check[1:]], env=env, capture_output=True, text=True, timeout=30)
        env["NARWHAL_SERVER__BIND"] = f"0.0.0.0:{_free_port()}"
        refused = subprocess.run([sys.executable, *check[1:]], env=env, capture_output=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert (ok.returncode, ok.stderr) == (0, "")
    assert refused.returncode != 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_manifests_and_the_readme_name_the_image_this_version_builds() -> None:
    _, container = _router_container()
    assert container["image"] == IMAGE
    assert f"docker build -t {IMAGE} ." in operator_docs()
    assert f"docker build -t {IMAGE} ." in DOCKERFILE.read_text()


def test_the_build_context_holds_only_what_the_dockerfile_copies() -> None:
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert lines == [
        "*", "!pyproject.toml", "!README.md", "!LICENSE", "!gunicorn.conf.py", "!narwhal/",
        "**/__pycache__", "**/*.pyc",
    ]


def test_hadolint_finds_nothing() -> None:
    # The test extra installs it into this environment, whose bin/ may not be on PATH.
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (the test extra installs it on linux x86_64 and aarch64)")
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def _container_engine() -> tuple[str | None, str]:
    """The first engine whose daemon answers, and why none did otherwise."""
    reasons = []
    for name in ("docker", "podman"):
        path = shutil.which(name)
        if path is None:
            reasons.append(f"{name}: not installed")
            continue
        proc = subprocess.run([path, "info"], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return path, ""
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        reasons.append(f"{name} info: {last}")
    return None, "; ".join(reasons)


@pytest.mark.timeout(1200)
def test_the_image_builds_and_runs_as_the_deployment_would() -> None:
    engine, why = _container_engine()
    if engine is None:
        pytest.skip(f"no working container engine ({why}); the Dockerfile is linted by the tests above")
    tag = f"narwhal-router-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run([engine, "build", "-t", tag, str(ROOT)], capture_output=True, text=True, timeout=1100)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    try:
        run = subprocess.run([engine, "run", "--rm", tag, "--version"], capture_output=True, text=True, timeout=60)
        assert (run.returncode, run.stdout) == (0, f"narwhal-router {VERSION}\n"), run.stderr
        # The tracing extra is in: [tracing] enabled = true starts in the image.
        otel = subprocess.run([engine, "run", "--rm", "--entrypoint", "python", tag, "-c",
                               "import opentelemetry.exporter.otlp.proto.http.trace_exporter"],
                              capture_output=True, text=True, timeout=60)
        assert otel.returncode == 0, otel.stderr
        inspect = subprocess.run([engine, "image", "inspect", tag], capture_output=True, text=True, timeout=60)
        config = json.loads(inspect.stdout)[0]["Config"]
        assert config["User"] == "10001:10001"
        assert config["Entrypoint"] == ["narwhal"]
        assert "NARWHAL_SERVER__BIND=0.0.0.0:8700" in config["Env"]
    finally:
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=60)
