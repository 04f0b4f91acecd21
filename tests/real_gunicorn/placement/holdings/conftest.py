"""The holdings tests' fleet and routers (docs/behaviour.md "Placement"): a fleet of fakes with their KV cache models,
the module's router over it, and a fresh pair for the tests whose choices depend on which
producers are full, which a module's shared fleet fills as its tests go."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import RELEASES
from tests.real_gunicorn.placement.holdings import holdings_support as hs


@pytest.fixture(scope="module", params=RELEASES, ids=[f"vllm-{r}" for r in RELEASES])
def hfleet(request: pytest.FixtureRequest) -> Iterator[FakeFleet]:
    """The module's fleet, of each vLLM release the fake imitates (docs/decisions.md "vLLM releases"): 0.11 teaches the
    holdings through usage's cached tokens, 0.33 through the descriptor's too."""
    yield from hs.module_fleet(request.param)


@pytest.fixture(scope="module")
def router(hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """The module's router over its fleet."""
    yield from hs.module_router(hfleet, tmp_path_factory)


@pytest.fixture
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, FakeFleet]]:
    """A fleet and router of the test's own: nothing held and nothing learned."""
    yield from hs.fresh_pair(tmp_path_factory)
