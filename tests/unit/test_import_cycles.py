"""No two modules import each other, directly or around a circle (``narwhal/`` and ``perf/``).

Why: a circle is one concept split across files, or a boundary drawn in the wrong place; either
way no module in it can be read, tested or changed alone. ``if TYPE_CHECKING:`` imports count:
they are arrows of the design too, only deferred. What was untied, and how: the connection
reports to its pool through a protocol (``engines.http1_connection.Pool``); a prefill's result
left the connector's rules (``engines.prefill_result``); the holdings' interface left the
``held`` policy (``fleet.placement.holdings_source``); the chaos phases' driver left the command
(``perf.chaos.driver``); the supervisor's discovery and model reader return decisions the loop
applies, reading the running fleet through a protocol (``supervisor.discovery.decisions.Running``), and
never import the supervisor (``supervisor.edge``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KNOWN: list[frozenset[str]] = []


def _modules() -> dict[str, Path]:
    found = {}
    for top in ("narwhal", "perf"):
        for path in (REPO / top).rglob("*.py"):
            if "results" in path.relative_to(REPO).parts:
                continue  # perf's git-ignored output, baselines' copies of narwhal/ among it
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # a package's own parent
                    graph[name].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.add(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        out.append(frozenset(members))
    return out


def test_no_modules_import_each_other_around_a_circle() -> None:
    circles = _circles(_graph(_modules()))
    assert sorted(map(sorted, circles)) == sorted(map(sorted, KNOWN))


def test_the_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [frozenset({"a", "b", "c"})]
