"""Real processes for the integration tests: one fake fleet, routers under real gunicorn.

One fake-fleet process serves every engine of the session; each router fixture is a real
gunicorn master with 2 aiohttp workers on an inherited 127.0.0.1 socket. Faults are injected
per request (``narwhal_fake`` in the body, which the router forwards like any unknown field)
or per engine through the fleet's control API. Every test writes a unique prompt so it can
find exactly the engine requests it caused.

At the end of each module every producer must hold zero KV blocks: a handoff the router
produced and neither decoded nor released would show up here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet
from tests.real_gunicorn.fixtures import engines_named, no_blocks_held, router_fixture
from tests.real_gunicorn.support import ENGINES, FLEET_ARGS


@pytest.fixture(scope="session")
def fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(ENGINES, args=FLEET_ARGS)
    yield fleet
    fleet.stop()


router = router_fixture(engines_named("p0", "p1", "d0", "d1"), "p0, p1 → d0, d1: crossed decodes only.")
same_router = router_fixture(engines_named("b0"), "b0 alone, role both: every decode is a same-worker decode.")
solo_router = router_fixture(
    engines_named("p2", "d2"), "p2 → d2 only, no silence bound, a short handoff age: deterministic placement.",
    engine={"decode_read_timeout_s": 0}, handoff={"max_age_s": 0.6},
)


@pytest.fixture(scope="module", autouse=True)
def no_stranded_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "fleet" not in request.fixturenames or hasattr(request.module, "fleet"):
        return  # a module's own fleet of each release checks itself as it stops (fixtures.release_fleet)
    no_blocks_held(request.getfixturevalue("fleet"))
