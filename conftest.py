"""Root conftest: a clear message instead of an INTERNALERROR when the test extra is missing, and
the real tier (``tests/real_vllm``) kept out of the fast suite.

The real tier runs real vLLM engines from a venv of its own (docs/testing.md): it is collected
only when named on the command line (``pytest tests/real_vllm``, as ``.ci/run`` does after the
fast suite), never by a bare ``pytest``. Named, it fails loudly when its environment cannot be
built; ``--skip-real-vllm`` (or ``NARWHAL_SKIP_REAL_VLLM=1``) is the one explicit way to skip it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_MISSING = [m for m in ("pytest_asyncio", "aiohttp", "orjson") if importlib.util.find_spec(m) is None]


REAL_TIER = Path(__file__).resolve().parent / "tests" / "real_vllm"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--skip-real-vllm", action="store_true",
                     help="skip the real-vLLM tier even when it is named (tests/real_vllm)")
    if importlib.util.find_spec("pytest_asyncio") is None:
        # Declared so the ini file parses; the run is then stopped with a one-line reason.
        parser.addini("asyncio_mode", "placeholder")
        parser.addini("asyncio_default_fixture_loop_scope", "placeholder")


def pytest_configure(config: pytest.Config) -> None:
    if _MISSING:
        raise pytest.UsageError(
            f"missing {', '.join(_MISSING)}: run the README's test command "
            "(python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest)"
        )


def _names_real_tier(config: pytest.Config) -> bool:
    for arg in config.args:
        path = Path(arg.split("::", 1)[0]).resolve()
        if path == REAL_TIER or REAL_TIER in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The real tier is collected only when named (the module's text)."""
    if collection_path == REAL_TIER and not _names_real_tier(config):
        return True
    return None
