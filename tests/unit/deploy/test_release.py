"""How Narwhal is installed: commands that work, a release workflow, and CI installing the wheel.

Why: the README, ``deploy/README.md`` and the systemd unit said ``pip install
narwhal-router``, a name the package registry does not have. The docs now install from a clone or
a wheel; a tag builds the sdist, the wheel and the image with no token in the repository
(trusted publishing); ``.ci/run`` builds the wheel and runs it from a fresh venv.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

import yaml

from tests.unit.deploy.deploy_support import ROOT, operator_docs

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _workflow() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True)  # YAML 1.1 reads the key `on` as true
    return doc


def _runs(job: dict[str, Any]) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def _uses(job: dict[str, Any]) -> list[str]:
    return [step["uses"].split("@")[0] for step in job["steps"] if "uses" in step]


def test_no_doc_installs_a_name_the_registry_does_not_have() -> None:
    settings = ROOT / "narwhal" / "settings" / "__init__.py"
    texts = {p: p.read_text() for p in (ROOT / "README.md", ROOT / "Dockerfile", settings,
                                        *sorted((ROOT / "deploy").rglob("*"))) if p.is_file()}
    assert [p.name for p, t in texts.items() if re.search(r"pip install '?narwhal-router", t)] == []
    readme = operator_docs()
    wheel = f"dist/narwhal_router-{VERSION}-py3-none-any.whl"
    assert "/opt/narwhal/venv/bin/pip install .  " in readme and f"/opt/narwhal/venv/bin/pip install {wheel}" in readme
    assert ".build/bin/python -m build" in readme


def test_a_tag_builds_the_sdist_the_wheel_and_the_image() -> None:
    doc = _workflow()
    assert doc["on"] == {"push": {"tags": ["v*"]}}
    assert doc["permissions"] == {"contents": "read"}
    jobs = doc["jobs"]
    assert sorted(jobs) == ["dist", "image", "publish"]
    dist = jobs["dist"]
    # Both distributions (no --wheel or --sdist), from the tag's own version.
    assert "python -m build --outdir dist ." in _runs(dist)
    assert 'test "$GITHUB_REF_NAME" = "v$version"' in _runs(dist)
    assert "narwhal demo --help" in _runs(dist) and "narwhal --version" in _runs(dist)
    image = jobs["image"]
    assert image["needs"] == "dist" and image["permissions"] == {"contents": "read", "packages": "write"}
    (push,) = [s for s in image["steps"] if s.get("uses", "").startswith("docker/build-push-action@")]
    deployment = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    repository = container["image"].rsplit(":", 1)[0]
    assert push["with"]["tags"] == f"{repository}:${{{{ needs.dist.outputs.version }}}}"
    assert push["with"]["context"] == "." and push["with"]["push"] is True


def test_publishing_is_trusted_with_no_token_in_the_repository() -> None:
    doc = _workflow()
    publish = doc["jobs"]["publish"]
    assert publish["permissions"] == {"id-token": "write"}  # OpenID Connect: the registry trusts this job
    assert publish["environment"]["name"] == "pypi"
    assert _uses(publish) == ["actions/download-artifact", "pypa/gh-action-pypi-publish"]
    (step,) = [s for s in publish["steps"] if s["uses"].startswith("pypa/")]
    assert "with" not in step  # no user, no password: trusted publishing
    # The only secret is the run's own GITHUB_TOKEN (for ghcr.io), issued per run.
    assert set(re.findall(r"secrets\.([A-Za-z_]+)", WORKFLOW.read_text())) == {"GITHUB_TOKEN"}
    assert "id-token" not in str(doc["jobs"]["image"]) and "id-token" not in str(doc["jobs"]["dist"])


def test_ci_builds_the_wheel_with_a_tool_the_test_extra_installs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"build\b", req) for req in extras["test"])
    run = (ROOT / ".ci" / "run").read_text()
    body = run.split("check_wheel() {", 1)[1].split("\n}\n", 1)[0]
    assert '.venv/bin/python -m build --wheel --outdir "$work/dist" .' in body
    assert 'python3 -m venv "$work/venv"' in body
    assert '(cd "$work" && test "$("$work/venv/bin/narwhal" --version)" = "narwhal-router $version")' in body
    assert '(cd "$work" && "$work/venv/bin/narwhal" demo --help >/dev/null)' in body
