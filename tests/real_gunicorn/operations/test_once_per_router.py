""""Once per engine" means once across the router, not once per worker (docs/behaviour.md).

The transfer-mode disagreement (a producer's handoffs name another ``transfer_mode`` than its
``engines[].transfer_mode``) is one warning for the whole router: both workers see it, and the
first to see it says it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import completion, post, sessions_per_worker, start_router, unique_prompt

WARNING = "its handoffs say transfer_mode"


@pytest.fixture(scope="module")
def disagreeing(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    # The fakes run pull; the router is told push for both: compatible by the setting, so pairs
    # are placed, and every handoff says "pull".
    engines = [{"name": "p2", "role": "producer", "transfer_mode": "push"},
               {"name": "d2", "role": "consumer", "transfer_mode": "push"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("once"), log={"level": "warning"})
    yield proc
    proc.stop()


async def test_a_disagreement_seen_by_every_worker_is_one_warning(disagreeing: RouterProcess) -> None:
    async with sessions_per_worker(disagreeing, 2) as sessions:
        for _ in range(3):
            for session in sessions.values():
                status, _ = await post(session, disagreeing, completion(unique_prompt(), max_tokens=2))
                assert status == 200
    lines = [line for line in disagreeing.log_text().splitlines() if WARNING in line]
    assert len(lines) == 1, lines
    assert "engine p2" in lines[0] and "'pull'" in lines[0] and "'push'" in lines[0]
