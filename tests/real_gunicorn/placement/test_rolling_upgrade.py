"""A rolling upgrade under load (docs/decisions.md "vLLM releases"): producers and consumers move one by one
from vLLM 0.32.0 to 0.33.0 while requests run. NIXL hands off only between engines of one
version, so Narwhal pairs only compatible engines: every request is served, the fakes count 0
``incompatible_decodes``, and no breaker charges an engine.

Each engine goes the way an operator upgrades one: drain it (admin API), wait for its legs to
end, stop it, start the new release, wait until the router shows its new version, readmit it.
The order keeps a compatible pair serving at every step: a consumer first (it idles until a
producer of its version comes), then both producers, then the last consumer. The router learns
the new version because the restarted engine refused connections and then answered again: its
``/version`` is read again (``Checks.connected``), and the test readmits it only once every
worker shows the new version (docs/deploy.md "A rolling upgrade")."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    AUTH,
    MODEL,
    TOKEN,
    admin,
    completion,
    engine_entry,
    send,
    sessions_per_worker,
    start_router,
    unique_prompt,
    wait_state,
)

OLD, NEW = "0.32.0", "0.33.0"
ENGINES = [("up0", "producer"), ("up1", "producer"), ("ud0", "consumer"), ("ud1", "consumer")]
ORDER = ["ud0", "up0", "up1", "ud1"]
CLIENTS = 4
BOUND_S = 90.0


@pytest.fixture(scope="module")
def upgrading() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start([n for n, _ in ENGINES],
                            args=["--vllm-version", OLD, "--model", MODEL, "--lease-s", "60", "--block-size", "4"])
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def upgrade_router(upgrading: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    router = start_router(upgrading, [{"name": n, "role": r} for n, r in ENGINES],
                          tmp_path_factory.mktemp("upgrade"), server={"workers": 2, "admin_token": TOKEN})
    yield router
    router.stop()


async def _until(check: object, what: str, bound_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while not await check():  # type: ignore[operator]
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _upgrade(router: RouterProcess, fleet: FakeFleet, name: str) -> None:
    await admin(router, "POST", f"/admin/engines/{name}/drain")
    await _until(lambda: _idle(router, name), f"{name}'s legs to end")
    fleet.control_request("POST", f"/engines/{name}/stop")
    await _until(lambda: _field(router, name, "unreachable", True), f"{name} seen down")
    fleet.control_request("POST", f"/engines/{name}/start?restart=1&version={NEW}")  # a process of the new release
    # Every worker shows the new version before the readmit: each follows the published version
    # within 0.25 s, and a worker that still had the old one would pair it with the old release.
    await _until(lambda: _every_worker_shows(router, name, NEW), f"{name}'s new version in every worker")
    await _until(lambda: _field(router, name, "unreachable", False), f"{name} reachable again")
    await admin(router, "POST", f"/admin/engines/{name}/readmit")
    await wait_state(router, name, "admitted")


async def _idle(router: RouterProcess, name: str) -> bool:
    inflight = (await engine_entry(router, name))["inflight"]
    return bool(inflight["prefill"] == 0 and inflight["decode"] == 0)


async def _every_worker_shows(router: RouterProcess, name: str, version: str) -> bool:
    async with sessions_per_worker(router, 2) as sessions:
        for session in sessions.values():
            async with session.get(router.url + "/admin/engines", headers=AUTH) as resp:
                entry = next(e for e in (await resp.json())["engines"] if e["name"] == name)
            if entry["version"] != version:
                return False
    return True


async def _field(router: RouterProcess, name: str, key: str, expected: object) -> bool:
    return bool((await engine_entry(router, name))[key] == expected)


async def test_a_rolling_upgrade_under_load_pairs_only_compatible_engines(
    upgrade_router: RouterProcess, upgrading: FakeFleet
) -> None:
    await _until(lambda: _field(upgrade_router, "ud1", "version", OLD), "the versions read at start")
    statuses: list[int] = []
    done = asyncio.Event()

    async def client() -> None:
        while not done.is_set():
            reply = await send(upgrade_router.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
            statuses.append(reply.status)

    loop = asyncio.get_running_loop()
    clients = [asyncio.ensure_future(client()) for _ in range(CLIENTS)]
    try:
        async with asyncio.timeout(BOUND_S):
            for name in ORDER:
                await _upgrade(upgrade_router, upgrading, name)
    finally:
        done.set()
        await asyncio.gather(*clients)
    assert loop.time() > 0 and len(statuses) >= 50, len(statuses)
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert [upgrading.stats(n)["incompatible_decodes"] for n, _ in ENGINES] == [0, 0, 0, 0]
    for name, _ in ENGINES:
        entry = await engine_entry(upgrade_router, name)
        assert (entry["version"], entry["failure_streak"], entry["ejections"]) == (NEW, 0, 0), entry
    assert "-> ejected" not in upgrade_router.log_text()
