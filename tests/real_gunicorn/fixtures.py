"""The real-gunicorn tests' fixture factories: a module names its router and its clean-up in a
line or two, and every router starts, and stops, the one way :func:`support.start_router` does."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import ENGINES, FLEET_ARGS, start_router, wait_until

# The vLLM releases the fake imitates (docs/decisions.md "vLLM releases"): the request-path suites run on a fleet of
# each.
RELEASES = ("0.11.0", "0.33.0")


def no_blocks_held(fleet: FakeFleet) -> None:
    """At the end of a module every producer holds zero KV blocks: a handoff the router produced
    and neither decoded nor released would show up here (bounded wait for the last releases)."""
    def held() -> dict[str, int]:
        return {n: blocks for n in fleet.engines if (blocks := fleet.stats(n)["held_blocks"])}

    try:
        wait_until(lambda: not held(), 10, "held KV blocks back to 0")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: still held {held()}") from None


def release_fleet(names: Sequence[str] = ENGINES, args: Sequence[str] = FLEET_ARGS,
                  releases: Sequence[str] = RELEASES) -> Any:
    """A module-scoped ``fleet`` parametrized over ``releases`` (:data:`RELEASES`): a module that
    names it (``fleet = release_fleet()``) runs every test on a fleet of each release, written
    once; its routers are module-scoped too, so each release gets its own."""

    @pytest.fixture(scope="module", params=list(releases), ids=[f"vllm-{r}" for r in releases])
    def fixture(request: pytest.FixtureRequest) -> Iterator[FakeFleet]:
        fleet = FakeFleet.start(list(names), args=[*args, "--vllm-version", request.param])
        try:
            yield fleet
            no_blocks_held(fleet)
        finally:
            fleet.stop()

    fixture.__doc__ = "A fleet of fakes of each vLLM release the fake imitates, one after the other."
    return fixture


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
