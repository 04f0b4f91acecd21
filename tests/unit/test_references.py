"""Every repository path the docs, the deploy files and the code's comments name exists.

Why: the systemd unit pointed at a test module that had moved and the
Dockerfile at a test that lived elsewhere; a reader following them found nothing. Every tracked
text file is read; a path is a token starting with one of the repository's top-level folders
(``narwhal/``, ``tests/``, ``deploy/``, ``perf/``, ``.ci/``, ``.github/``). It counts as found if
it exists, names a module without its ``.py`` (``perf/load/generator``, ``perf/load/generator.run_round``), or is
ignored by git (generated output such as ``perf/results/``).
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_PATH = re.compile(r"(?<![\w./\-~$])((?:narwhal|tests|deploy|perf|\.ci|\.github)/[\w./\-]*[\w/])")
# Not paths: a kubectl resource (`kubectl logs deploy/narwhal`), named in the README's commands.
NOT_PATHS = {"deploy/narwhal"}


def _tracked_texts() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    texts = {}
    for name in filter(None, names.stdout.split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the work tree, not yet committed
        try:
            texts[name] = path.read_text()
        except UnicodeDecodeError:
            continue  # images
    return texts


def _found(path: str) -> bool:
    if path in NOT_PATHS or (ROOT / path).exists() or (ROOT / f"{path}.py").exists():
        return True
    module, dot, _ = path.rpartition(".")
    if dot and "/" in module and (ROOT / f"{module}.py").exists():
        return True
    ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True)
    return ignored.returncode == 0


def test_every_named_repository_path_exists() -> None:
    missing: dict[str, list[str]] = {}
    for name, text in _tracked_texts().items():
        for match in _PATH.finditer(text):
            if text[match.end():match.end() + 1] in ("*", "{", "<"):
                continue  # a pattern (tests/real_gunicorn/test_*.py), not one path
            if not _found(match.group(1)):
                missing.setdefault(match.group(1), []).append(name)
    assert missing == {}


def test_the_operator_docs_cite_no_file_the_operator_does_not_have() -> None:
    # The contract (SPEC.md) ships beside the repository, for developers (ARCHITECTURE.md may
    # cite it); the README and deploy/README.md name their own sections instead.
    for doc in (ROOT / "README.md", ROOT / "deploy" / "README.md"):
        cited = [line for line in doc.read_text().splitlines() if "SPEC" in line]
        assert cited == [], doc.name


# What the code may cite: its own docs. The contract's text outside the repository (the SPEC, the
# protocol notes) and the tracker's issues are not in a clone; a reader must be able to follow
# every reference, so comments and docstrings cite docs/*.md by section instead.
_OUTSIDE = re.compile(r"\bSPEC\b|(?i:\bissues? #?[0-9]+)|VLLM-PROTOCOL|NOTES\.md")
_CITED_SECTION = re.compile(r'docs/(\w+)\.md "([^"\n]+)"')


def _comments_and_strings(text: str) -> list[tuple[int, str]]:
    """Every comment and string literal of a Python source, with its first line (names are code, not text)."""
    found: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            found.append((tok.start[0], tok.string))
    return found


def _sections(doc: str) -> list[str]:
    """A doc's headings and its bold run-in headings (``**Endpoints per release.**``), as cited."""
    text = (ROOT / "docs" / f"{doc}.md").read_text()
    heads = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return heads + re.findall(r"\*\*([^*\n]+)\*\*", text)


def test_the_code_cites_only_what_the_repository_holds() -> None:
    outside: list[str] = []
    unknown: list[str] = []
    for name, text in _tracked_texts().items():
        if not name.endswith(".py") or not name.startswith(("narwhal/", "tests/", "perf/")):
            continue
        for line, piece in _comments_and_strings(text):
            if name != "tests/unit/test_references.py" and _OUTSIDE.search(piece):
                outside.append(f"{name}:{line}")
            for doc, section in _CITED_SECTION.findall(piece):
                if not (ROOT / "docs" / f"{doc}.md").exists() or not any(
                        s.startswith(section) for s in _sections(doc)):
                    unknown.append(f'{name}:{line}: docs/{doc}.md "{section}"')
    assert outside == []
    assert unknown == []


def test_the_docs_deploy_files_and_scripts_cite_only_what_the_repository_holds() -> None:
    # Every tracked text beside the code: README, ARCHITECTURE, docs/, perf/*.md, deploy/'s
    # settings, manifests, dashboards and alert rules, .ci/run.
    outside = [f"{name}:{text.count(chr(10), 0, found.start()) + 1}"
               for name, text in _tracked_texts().items()
               if not name.endswith(".py") and (found := _OUTSIDE.search(text)) is not None]
    assert outside == []


_STEP_BY_NUMBER = re.compile(r'request path"(?:\'s)?,?\s+(?:#\s*)?steps?\s+[0-9]')


def test_the_request_paths_steps_are_cited_by_their_names() -> None:
    # docs/behaviour.md "The request path" numbers its seven steps; citations by number drifted
    # from them (a step 8 that never existed), so the code, the tests and the docs cite the bold
    # names ("Handoff validation"), which the check above resolves.
    by_number = [f"{name}:{text.count(chr(10), 0, found.start()) + 1}"
                 for name, text in _tracked_texts().items()
                 for found in _STEP_BY_NUMBER.finditer(text)]
    assert by_number == []
    names = re.findall(r"^\d\. \*\*([^*]+)\*\*", (ROOT / "docs" / "behaviour.md").read_text(), re.M)
    assert [n.rstrip(".") for n in names[:7]] == [
        "Admission", "Placement", "Prefill", "Handoff validation", "Decode", "Cleanup", "A consumer's refusal"]
    walk = (ROOT / "ARCHITECTURE.md").read_text().split("## One streaming request, step by step")[1]
    headings = re.findall(r"^### (.+)$", walk.split("\n## ")[0], re.M)
    assert headings == [n.rstrip(".") for n in names[:7]]
