"""The shared-memory tests' region: one fixture, so each module does not open its own copy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.shm.shared import SharedFleet


@pytest.fixture
def shared() -> Iterator[SharedFleet]:
    """A fresh fleet region of 4 engine slots, 4 worker slots and 8-entry rings, closed after the test."""
    fleet = SharedFleet.create(engines=4, slots=4, ring=8)
    yield fleet
    fleet.close()
