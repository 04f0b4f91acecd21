"""Root conftest: a clear message instead of an INTERNALERROR when the test extra is missing."""

from __future__ import annotations

import importlib.util

import pytest

_MISSING = [m for m in ("pytest_asyncio", "aiohttp", "orjson") if importlib.util.find_spec(m) is None]


def pytest_addoption(parser: pytest.Parser) -> None:
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
