"""The supervisor tests' shared-memory fleet: ``shared``, a region of 4 engine slots and 2 worker
slots holding the engines of the module's ``settings`` fixture (a module that needs another
region defines its own ``shared``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.settings import Settings
from narwhal.shm.shared import SharedFleet


@pytest.fixture
def shared(settings: Settings) -> Iterator[SharedFleet]:
    """The region, its engines assigned as the supervisor's start assigns them; closed after."""
    region = SharedFleet.create(engines=4, slots=2)
    region.assign_engines([(e.name, e.url) for e in settings.engines])
    yield region
    region.close()
