"""The hostile-client tests' router, `hostile`: one per test module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.hostile_support import worker_pids
from tests.real_gunicorn.support import start_router


@pytest.fixture(scope="module")
def hostile(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """p2 → d2 with short client-side bounds: a stuck reader is dropped after 2 s, a slow body 408s after 1 s."""
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    proc = start_router(
        fleet,
        engines,
        tmp_path_factory.mktemp("hostile"),
        server={"client_write_timeout_s": 2, "body_read_timeout_s": 1},
    )
    # The master's children (workers and the supervisor) at start: nothing may replace them.
    proc.initial_children = worker_pids(proc)  # type: ignore[attr-defined]
    yield proc
    proc.stop()
