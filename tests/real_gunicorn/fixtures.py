"""The real-gunicorn tests' fixture factories: a module names its router and its clean-up in a
line or two, and every router starts, and stops, the one way :func:`support.start_router` does."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import start_router


def engines_named(*names: str, **extra: Any) -> list[dict[str, Any]]:
    """Engine entries for ``names`` with the role their prefix says (``p``/``sp`` producer,
    ``d``/``sd`` consumer, ``b`` both); ``extra`` is added to every entry."""
    roles = {"p": "producer", "d": "consumer", "b": "both"}
    return [{"name": n, "role": roles[n.removeprefix("s")[0]], **extra} for n in names]


def router_fixture(engines: list[dict[str, Any]], doc: str,
                   on_start: Callable[[RouterProcess], None] | None = None, **sections: dict[str, Any]) -> Any:
    """A module-scoped fixture, named as the module names it (``solo = router_fixture(...)``): a
    router over ``engines`` configured with ``sections`` (as :func:`start_router` takes them),
    started once for the module and stopped after it."""

    @pytest.fixture(scope="module")
    def fixture(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
        proc = start_router(fleet, [dict(e) for e in engines], tmp_path_factory.mktemp("router"), **sections)
        try:
            if on_start is not None:
                on_start(proc)
            yield proc
        finally:
            proc.stop()

    fixture.__doc__ = doc
    return fixture


def faults_cleared_after_each(*names: str) -> Any:
    """An autouse fixture: after each test, ``names`` lose their injected faults and, if a test
    stopped them, serve again (so no test inherits another's engine state)."""

    @pytest.fixture(autouse=True)
    def fixture(fleet: FakeFleet) -> Iterator[None]:
        yield
        for name in names:
            fleet.control_request("DELETE", f"/engines/{name}/faults")
            fleet.control_request("POST", f"/engines/{name}/start")

    return fixture
