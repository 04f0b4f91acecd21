"""The hostile-client tests' router, `hostile`: one per test module that asks for it."""

from __future__ import annotations

from narwhal.testing.harness import RouterProcess
from tests.real_gunicorn.fixtures import engines_named, router_fixture
from tests.real_gunicorn.hostile_support import worker_pids


def _note_children(proc: RouterProcess) -> None:
    # The master's children (workers and the supervisor) at start: nothing may replace them.
    proc.initial_children = worker_pids(proc)  # type: ignore[attr-defined]


hostile = router_fixture(
    engines_named("p2", "d2"), "p2 → d2 with short client-side bounds: a stuck reader is dropped after 2 s, "
    "a slow body 408s after 1 s.", on_start=_note_children,
    server={"client_write_timeout_s": 2, "body_read_timeout_s": 1},
)
