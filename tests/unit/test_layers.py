"""Arrows only downward: every ``narwhal`` import goes to its own layer or one below (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import narwhal

ROOT = Path(narwhal.__file__).resolve().parent
# Top to bottom, as ARCHITECTURE.md lists them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("commands", ("narwhal.cli", "narwhal.demo", "narwhal.status", "narwhal.sizing", "narwhal.__main__",
                  "narwhal.app")),
    ("testing", ("narwhal.testing",)),
    ("master", ("narwhal.master",)),
    ("worker", ("narwhal.worker",)),
    ("request", ("narwhal.request",)),
    ("supervisor", ("narwhal.supervisor",)),
    ("preflight", ("narwhal.preflight",)),
    ("shm", ("narwhal.shm",)),
    ("fleet", ("narwhal.fleet",)),
    ("engines", ("narwhal.engines",)),
    ("fake engine", ("narwhal.fake_engine",)),
    ("base", ("narwhal.settings", "narwhal.errors", "narwhal.reasons", "narwhal.metrics",
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


def test_the_workers_code_never_imports_the_supervisors() -> None:
    # Two processes that share memory, not code paths: what both sides must agree on (a record's
    # form, a read's timeout) lives in narwhal/shm/, which each imports.
    crossing = [f"{_module(path)} imports {target}"
                for top in ("worker", "request") for path in (ROOT / top).rglob("*.py")
                for target in _imports(path) if target.startswith("narwhal.supervisor")]
    assert crossing == []


def test_the_check_sees_an_upward_import() -> None:
    assert _layer("narwhal.engines.client") > _layer("narwhal.request.router")
    assert _layer("narwhal.fleet.placement") > _layer("narwhal.shm.worker")



def _awaits(source: str) -> list[int]:
    """Lines of ``source`` that await, define a coroutine or import asyncio."""
    found = []
    for node in ast.walk(ast.parse(source)):
        is_async = isinstance(node, ast.AsyncFunctionDef | ast.Await | ast.AsyncFor | ast.AsyncWith)
        imports_asyncio = (isinstance(node, ast.Import) and any(a.name == "asyncio" for a in node.names)) or (
            isinstance(node, ast.ImportFrom) and node.module == "asyncio")
        if is_async or imports_asyncio:
            found.append(node.lineno)  # type: ignore[attr-defined]
    return found


def test_fleet_is_pure_it_never_awaits() -> None:
    # Decisions take time and state as arguments; whatever waits (the bounded wait for a slot)
    # lives in the request layer (narwhal/request/slot_wait.py).
    awaiting = [f"{_module(p)}:{line}" for p in (ROOT / "fleet").rglob("*.py") for line in _awaits(p.read_text())]
    assert awaiting == []


def test_the_purity_check_sees_an_await() -> None:
    assert _awaits("import asyncio\nasync def f():\n    await g()\n") == [1, 2, 3]
    assert _awaits("from asyncio import sleep\ndef f():\n    return 1\n") == [1]
    assert _awaits((ROOT / "request" / "slot_wait.py").read_text())  # what moved out of fleet/ awaits


# Policy held's pieces, one per process: its ordering, its region and a worker's view of it, its
# supervisor part. Everything else reaches them through the Policy interface and the parts its
# region names (fleet/placement/policy.py PolicyRegion, supervisor/policy_part.py).
HELD_PIECES = ("narwhal.fleet.placement.held", "narwhal.shm.holdings", "narwhal.shm.holdings_view",
               "narwhal.supervisor.holdings")
HELD_OWNERS = (*HELD_PIECES, "narwhal.fleet.placement.registry")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_module_outside_the_policy_names_its_pieces() -> None:
    naming = [f"{_module(path)} imports {target}" for path in ROOT.rglob("*.py")
              if not _within(_module(path), HELD_OWNERS)
              for target in _imports(path) if _within(target, HELD_PIECES)]
    assert naming == []


def test_the_held_policys_parts_resolve_to_what_each_process_calls() -> None:
    from narwhal.fleet.placement.policy import part
    from narwhal.fleet.placement.registry import POLICIES
    from narwhal.settings import PlacementSettings
    from narwhal.shm.holdings_view import WorkerHoldings
    from narwhal.supervisor.holdings.part import HoldingsPart

    for name, cls in POLICIES.items():
        need = cls.region(PlacementSettings(policy=name))
        if need is None:
            continue
        assert callable(part(need.create))
        assert callable(part(need.worker))
        built = part(need.supervisor)
        assert isinstance(built, type) and built is HoldingsPart
        assert hasattr(WorkerHoldings, "roster")
