"""Shared state that follows a SIGHUP reload (issue 25 items 3 and 6), under real gunicorn.

A reload starts new workers on the new settings while old ones finish their streams: every new
worker must find a slot in shared memory, and what old workers report must land on the engine
they used, whatever the new engine list is.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess, children_of, write_config
from tests.real_gunicorn.support import AUTH, TIMEOUTS, TOKEN, admin, completion, send, unique_prompt, wait_until


def workers_of(router: RouterProcess) -> set[int]:
    booted = {int(pid) for pid in re.findall(r"Booting worker with pid: (\d+)", router.log_text())}
    return booted & set(children_of(router.proc.pid))


def _conf(workers: int, **extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    conf: dict[str, dict[str, Any]] = {
        "server": {"workers": workers, "admin_token": TOKEN, "graceful_timeout_s": 60},
        "engine": dict(TIMEOUTS),
        "preflight": {"on_start": False},
        "log": {"access_log": "", "level": "info"},
    }
    for key, values in extra.items():
        conf.setdefault(key, {}).update(values)
    return conf


def _rewrite(config: str, engines: list[dict[str, Any]], conf: dict[str, dict[str, Any]]) -> None:
    """The settings file the master re-reads on SIGHUP, replaced in place."""
    fresh = write_config(engines, conf)
    os.replace(fresh, config)


@asynccontextmanager
async def _streaming(router: RouterProcess, tokens: int = 400) -> AsyncIterator[aiohttp.ClientResponse]:
    """A stream through some worker, its first token already here; it outlives the test's checks."""
    async with aiohttp.ClientSession() as session:
        body = completion(unique_prompt(), max_tokens=tokens, fake={"decode": {"token_delay_s": 0.1}})
        async with session.post(router.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readany()
            yield resp


async def _until_workers(router: RouterProcess, expected: dict[str, int], timeout: float) -> dict[str, int]:
    end = time.monotonic() + timeout
    seen: dict[str, int] = {}
    while time.monotonic() < end:
        seen = (await admin(router))["workers"]
        if seen == expected:
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"workers never {expected}: last {seen}")


@pytest.mark.timeout(120)
async def test_a_reload_raising_the_workers_gives_every_new_worker_a_slot(fleet: FakeFleet, tmp_path: Any) -> None:
    # 1 → 8 workers while the old one streams: 9 at once. The layout used to have
    # max(2 × workers, 8) = 8 slots, so one new worker ran on per-process state for good.
    engines = [{"name": n, "role": r, "url": fleet.engines[n]}
               for n, r in (("p0", "producer"), ("p1", "producer"), ("d0", "consumer"))]
    config = write_config(engines, _conf(1))
    router = RouterProcess.start(config, log_path=str(tmp_path / "router.log"))
    try:
        old = workers_of(router)
        assert (await admin(router))["workers"] == {"reached": 1, "running": 1}
        async with _streaming(router):
            _rewrite(config, engines, _conf(8))
            os.kill(router.proc.pid, signal.SIGHUP)
            wait_until(lambda: len(workers_of(router) - old) == 8, 60, "8 new workers")
            assert old <= workers_of(router)  # the old worker still drains its stream
            await _until_workers(router, {"reached": 9, "running": 9}, 30)
            # The answer says the ejection reached every worker, the draining one included.
            reply = await send(router.url, "/admin/engines/p1/eject", method="POST", headers=AUTH)
            assert reply.status == 200
            assert (reply.json["state"], reply.json["workers"]) == ("ejected", {"reached": 9, "running": 9})
    finally:
        router.stop()
        os.unlink(config)
