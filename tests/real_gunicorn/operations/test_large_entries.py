"""Any engine entry the settings accept fits the shared tables (docs/behaviour.md; docs/settings.md).

An entry with 64 ``kv_peers`` and 32 model names of 100 characters used to stop the start
(``its description is over 1010 bytes``): the descriptor slot was a fixed 1 KiB. The router
starts with it and serves through it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    admin,
    completion,
    expected_text,
    send,
    start_router,
    unique_prompt,
)

MODELS = [MODEL] + [f"org/{'m' * 90}-{i:03d}" for i in range(31)]
PEERS = ["d2"] + [f"peer-{i:02d}" for i in range(63)]


@pytest.fixture(scope="module")
def large(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "p2", "role": "producer", "kv_peers": PEERS, "models": MODELS},
               {"name": "d2", "role": "consumer", "models": MODELS}]
    # The other 63 peers: consumers at addresses nothing listens on (refused at once).
    engines += [{"name": name, "role": "consumer", "url": f"http://127.0.0.1:{9 + i}"}
                for i, name in enumerate(PEERS[1:])]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("large"), server={"max_engines": 128,
                                                                                   "admin_token": TOKEN})
    yield proc
    proc.stop()


async def test_an_entry_with_64_peers_and_32_long_models_starts_and_serves(large: RouterProcess) -> None:
    p2 = next(e for e in (await admin(large))["engines"] if e["name"] == "p2")
    assert sorted(p2["models"]) == sorted(MODELS)
    reply = await send(large.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
    assert reply.status == 200 and reply.text == expected_text(3)
