"""Arrows only downward: every ``narwhal`` import goes to its own layer or one below (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import narwhal

ROOT = Path(narwhal.__file__).resolve().parent
# Top to bottom, as ARCHITECTURE.md lists them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("commands", ("narwhal.cli", "narwhal.demo", "narwhal.__main__", "narwhal.app")),
    ("testing", ("narwhal.testing",)),
    ("front", ("narwhal.front",)),
    ("request", ("narwhal.request",)),
    ("supervisor", ("narwhal.supervisor",)),
    ("preflight", ("narwhal.preflight",)),
    ("shm", ("narwhal.shm",)),
    ("fleet", ("narwhal.fleet",)),
    ("engines", ("narwhal.engines",)),
    ("fake engine", ("narwhal.fake_engine",)),
    ("base", ("narwhal.settings", "narwhal.settings_env", "narwhal.errors", "narwhal.reasons", "narwhal.metrics",
              "narwhal.metric_tally", "narwhal.logs", "narwhal")),
]


def _layer(module: str) -> int:
    best, length = len(LAYERS), -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    return best


def _imports(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "narwhal":
            if node.module == "narwhal":
                found.extend(f"narwhal.{alias.name}" for alias in node.names)
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name.split(".")[0] == "narwhal")
    return found


def _module(path: Path) -> str:
    parts = ("narwhal", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = [_module(p) for p in ROOT.rglob("*.py") if _layer(_module(p)) == len(LAYERS)]
    assert unplaced == []


def test_imports_point_down() -> None:
    upward = []
    for path in ROOT.rglob("*.py"):
        me = _module(path)
        for target in _imports(path):
            if _layer(target) < _layer(me):
                upward.append(f"{me} ({LAYERS[_layer(me)][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
    assert upward == []


def test_the_check_sees_an_upward_import() -> None:
    assert _layer("narwhal.engines.client") > _layer("narwhal.request.router")
    assert _layer("narwhal.fleet.placement") > _layer("narwhal.shm.worker")
