"""The fake engine tests' fixtures: one fake engine and an aiohttp test client on it."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, build_engine_app
from tests.unit.fake_engine.fe_support import ClientFactory


@pytest.fixture
def engine() -> FakeEngine:
    """A fake engine named e0 (the default release, 0.33.0, serving generate) with every model off."""
    return FakeEngine("e0", enable_scale_out=True)


@pytest.fixture
async def client(aiohttp_client: ClientFactory, engine: FakeEngine) -> TestClient[Any, Any]:
    """An aiohttp test client on ``engine``'s app."""
    return await aiohttp_client(build_engine_app(engine))
