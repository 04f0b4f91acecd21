"""Every public class, function and method in narwhal/ has a docstring saying what it is for.

Why a test: a newcomer reads a name's one line to learn what it is for and the
invariant it keeps; a name without one sends them into its body. Public is a name not starting
with ``_``, at module level or in a public class (methods included); dunders and private names
are left alone. ``NOT_YET`` lists the modules being refactored while the docstrings were written;
it may only shrink: a listed module that is fully documented (or gone) fails
``test_not_yet_lists_only_modules_still_undocumented``, so the set cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "narwhal"

# Under refactor when the docstrings went in: the lead documents each as its
# refactor lands and removes it here; the set shrinks to empty.
NOT_YET: set[str] = set()


def undocumented(source: str) -> list[str]:
    """``line name`` of each public class, function and method of ``source`` without a docstring."""
    missing: list[str] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if child.name.startswith("_"):
                    continue
                if ast.get_docstring(child) is None:
                    missing.append(f"{child.lineno} {prefix}{child.name}")
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(source), "")
    return missing


def _modules() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_checker_sees_public_names_only() -> None:
    source = (
        "def f(): pass\n"
        "def _g(): pass\n"
        "class C:\n"
        '    """A class."""\n'
        "    def m(self): pass\n"
        "    def __init__(self): pass\n"
        "    def _p(self): pass\n"
        "class _Hidden:\n"
        "    def m(self): pass\n"
        "async def h():\n"
        '    """Documented."""\n'
    )
    assert undocumented(source) == ["1 f", "5 C.m"]


def test_every_public_name_has_a_docstring() -> None:
    modules = _modules()
    assert len(modules) > 50  # the scan really sees the package
    missing = [f"{name}:{hit}" for name, text in modules.items() if name not in NOT_YET for hit in undocumented(text)]
    assert missing == []


def test_not_yet_lists_only_modules_still_undocumented() -> None:
    modules = _modules()
    done = sorted(name for name in NOT_YET if not undocumented(modules.get(name, "")))
    assert done == [], "documented (or gone): remove from NOT_YET"


def _package_faces() -> dict[str, tuple[list[str], list[str]]]:
    """Per package below ``narwhal/``: (its modules and subpackages its ``__init__.py`` does not
    name, the top-level statements there that are not imports, ``__all__`` or the docstring)."""
    faces: dict[str, tuple[list[str], list[str]]] = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        package = init.parent
        if package == PACKAGE:
            continue  # the root: ARCHITECTURE.md is its face
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree) or ""
        names = [p.stem for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        names += [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
        unnamed = sorted(n for n in names if not any(
            form in doc for form in (f"``{n}.py``", f"``{n}/``", f":mod:`.{n}`")))
        code = [f"{node.lineno}" for node in tree.body[1:]
                if not isinstance(node, ast.Import | ast.ImportFrom)
                and not (isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"])
                and not (isinstance(node, ast.AnnAssign | ast.Assign | ast.If) and init.parent.name == "shm")]
        faces[str(package.relative_to(ROOT))] = (unnamed, code)
    return faces


def test_each_package_names_its_modules_and_keeps_no_code_in_its_init() -> None:
    # A package's __init__.py is its face: one line per module, then its exports. Code there is
    # where nobody looks for it (shm's is the exception: the regions every process inherits).
    faces = _package_faces()
    assert {name: face for name, face in faces.items() if face != ([], [])} == {}
