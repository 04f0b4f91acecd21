"""The fake engine's module layout (narwhal/fake_engine/): no import cycles, small modules.

Why a test: the package once had engine ↔ kv/routes/generate cycles hidden behind
``TYPE_CHECKING`` imports, so every import counts here, wherever it sits (inside functions and
``if TYPE_CHECKING:`` blocks too). The implicit import of a package by its own submodules is not
an edge (Python imports ``narwhal.fake_engine`` before any ``narwhal.fake_engine.x`` anyway);
``from narwhal.fake_engine import name`` of a name that is not a submodule *is* an edge to the
package's ``__init__``, which imports the top of the stack.

The fake also shares no code with the router (it must keep imitating vLLM's wire format on its
own, docs/behaviour.md "Fake engines"): from ``narwhal`` it imports ``narwhal.fake_engine.*`` only.

Run as a script to print the import graph and the sizes.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "narwhal.fake_engine"
ROOT = Path(__file__).resolve().parents[3] / "narwhal" / "fake_engine"
MAX_MODULE_LINES = 600  # the house's backstop (tests/unit/test_house_sizes.py)
MAX_FUNCTION_LINES = 80


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (not subpackages' insides)."""
    files: dict[str, Path] = {}
    for path in sorted(root.glob("*.py")):
        files[package if path.name == "__init__.py" else f"{package}.{path.stem}"] = path
    return files


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Absolute names a single import statement brings in, as ``name`` or ``name:attr``."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            anchor = parts if is_package else parts[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            yield f"{base}:{alias.name}"


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the package's modules, imports of other ``narwhal`` modules) per module."""
    files = module_files(root, package)
    edges: dict[str, set[str]] = {name: set() for name in files}
    foreign: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for imported in _imported(node, name, path.name == "__init__.py"):
                base, _, attr = imported.partition(":")
                target = f"{base}.{attr}" if attr and f"{base}.{attr}" in files else base
                if target in files:
                    if target != name:
                        edges[name].add(target)
                elif target == "narwhal" or target.startswith("narwhal."):
                    foreign[name].add(target)
    return edges, foreign


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def sizes(root: Path = ROOT, package: str = PACKAGE) -> tuple[dict[str, int], dict[str, int]]:
    """(lines per module, lines per function as ``module:qualname``), def line to last line."""
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for name, path in module_files(root, package).items():
        text = path.read_text()
        modules[name] = len(text.splitlines())

        def walk(node: ast.AST, prefix: str, mod: str = name) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    qualname = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        assert child.end_lineno is not None
                        functions[f"{mod}:{qualname}"] = child.end_lineno - child.lineno + 1
                    walk(child, qualname + ".", mod)
                else:
                    walk(child, prefix, mod)

        walk(ast.parse(text), "")
    return modules, functions


# -- the checker, checked ---------------------------------------------------------------------------


def _write_package(tmp_path: Path, modules: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    root.mkdir()
    for stem, source in modules.items():
        (root / f"{stem}.py").write_text(source)
    return root


def test_the_checker_sees_cycles_behind_type_checking_and_inside_functions(tmp_path: Path) -> None:
    root = _write_package(
        tmp_path,
        {
            "__init__": "from pkg.top import run\n",
            "top": "from pkg import low\n",
            "low": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.top import Top\n",
            "mid": "def f():\n    from . import leaf\n",
            "leaf": "def g():\n    import pkg.mid\n",
            "alone": "import pkg.low\nfrom narwhal.engines.sse import x\n",
        },
    )
    edges, foreign = import_graph(root, "pkg")
    assert edges["pkg.top"] == {"pkg.low"}
    assert edges["pkg.mid"] == {"pkg.leaf"}
    assert foreign["pkg.alone"] == {"narwhal.engines.sse"}
    assert sorted(find_cycles(edges)) == [["pkg.leaf", "pkg.mid"], ["pkg.low", "pkg.top"]]


def test_the_checker_counts_a_name_taken_from_the_package_as_an_edge_to_init(tmp_path: Path) -> None:
    root = _write_package(tmp_path, {"__init__": "from pkg.a import A\nX = 1\n", "a": "from pkg import X\n"})
    edges, _ = import_graph(root, "pkg")
    assert find_cycles(edges) == [["pkg", "pkg.a"]]


def test_the_checker_measures_functions_from_def_to_last_line(tmp_path: Path) -> None:
    root = _write_package(tmp_path, {"m": "class C:\n    def f(self):\n        x = 1\n        return x\n"})
    modules, functions = sizes(root, "pkg")
    assert modules == {"pkg.m": 4}
    assert functions == {"pkg.m:C.f": 3}


# -- the fake engine ---------------------------------------------------------------------------------


def test_fake_engine_has_no_import_cycle() -> None:
    edges, _ = import_graph()
    assert len(edges) >= 10  # the scan really sees the package
    assert find_cycles(edges) == []


def test_fake_engine_imports_nothing_else_from_narwhal() -> None:
    _, foreign = import_graph()
    assert {name: targets for name, targets in foreign.items() if targets} == {}


def test_fake_engine_modules_and_functions_stay_small() -> None:
    modules, functions = sizes()
    assert {m: n for m, n in modules.items() if n > MAX_MODULE_LINES} == {}
    assert {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES} == {}


def test_every_fake_engine_module_opens_with_a_docstring() -> None:
    missing = [name for name, path in module_files().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []


if __name__ == "__main__":
    graph, outside = import_graph()
    for mod in sorted(graph):
        print(f"{mod}: {', '.join(sorted(graph[mod])) or '-'}")
    print("cycles:", find_cycles(graph) or "none")
    print("other narwhal imports:", {m: t for m, t in outside.items() if t} or "none")
    module_lines, function_lines = sizes()
    print("largest modules:", sorted(module_lines.items(), key=lambda kv: -kv[1])[:3])
    print("largest functions:", sorted(function_lines.items(), key=lambda kv: -kv[1])[:3])
    sys.exit(1 if find_cycles(graph) else 0)
