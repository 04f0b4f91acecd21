"""Shared state that follows a SIGHUP reload, under real gunicorn.

A reload starts new workers on the new settings while old ones finish their streams: every new
worker must find a slot in shared memory, and what old workers report must land on the engine
they used, whatever the new engine list is.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import (
    SUPERVISOR_TITLE,
    FakeFleet,
    RouterProcess,
    children_of,
    process_title,
    write_config,
)
from tests.real_gunicorn.support import (
    AUTH,
    TIMEOUTS,
    TOKEN,
    admin,
    completion,
    send,
    unique_prompt,
    wait_until,
    workers_of,
)


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
        # Settled first: on a loaded host a worker gunicorn replaced at boot can still hold a slot
        # until the sweep (0.25 s) or child_exit gives it back.
        await _until_workers(router, {"reached": 1, "running": 1}, 30)
        old = workers_of(router)
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


def _supervisor_of(router: RouterProcess) -> int | None:
    found = [pid for pid in children_of(router.proc.pid) if SUPERVISOR_TITLE in process_title(pid)]
    return found[0] if found else None


@pytest.mark.timeout(120)
async def test_an_old_workers_report_after_a_reload_lands_on_the_engine_it_used(
    fleet: FakeFleet, tmp_path: Any
) -> None:
    # The old list is p0, d0, d1; the reload removes d0, so d1 moves from position 2 to 1. Keyed
    # by position, the old worker's report on its stream through d1 matched no engine (or,
    # with an engine at 2, the wrong one) and d1's breaker never heard of it.
    before = [{"name": n, "role": r, "url": fleet.engines[n]}
              for n, r in (("p0", "producer"), ("d0", "consumer"), ("d1", "consumer"))]
    before[2]["max_inflight_decode"] = 1
    after = [before[0], before[2]]
    recovery = {"eject_after": 1, "readmit_interval_s": 60, "readmit_interval_max_s": 60}
    placement = {"queue_timeout_s": 0.5}
    config = write_config(before, _conf(1, recovery=recovery, placement=placement))
    router = RouterProcess.start(config, log_path=str(tmp_path / "router.log"))
    try:
        wait_until(lambda: _supervisor_of(router) is not None, 10, "the supervisor titled")
        old_supervisor = _supervisor_of(router)
        assert (await admin(router, "POST", "/admin/engines/d0/eject"))["state"] == "ejected"  # streams go to d1
        async with aiohttp.ClientSession() as session:
            # The engine closes the stream after 150 tokens (~15 s): well after the new supervisor runs.
            body = completion(unique_prompt(), max_tokens=400,
                              fake={"decode": {"token_delay_s": 0.1, "close_after": 150}})
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readany()
                _rewrite(config, after, _conf(1, recovery=recovery, placement=placement))
                os.kill(router.proc.pid, signal.SIGHUP)
                wait_until(lambda: _supervisor_of(router) not in (None, old_supervisor), 15, "the new supervisor")
                wait_until(lambda: "d0" not in str(_names(router)), 15, "the new list served")
                entries = {e["name"]: e for e in (await admin(router))["engines"]}
                assert "d0" not in entries  # a new worker answered
                assert (entries["d1"]["state"], entries["d1"]["failure_streak"]) == ("admitted", 0)
                # The new worker counts the old worker's stream on d1, so d1's cap of 1 holds.
                assert entries["d1"]["inflight"] == {"prefill": 0, "decode": 1}
                capped = await send(router.url, "/v1/completions", completion(unique_prompt()))
                assert (capped.status, capped.headers["x-narwhal-error"]) == (503, "no_engine")
                await resp.read()  # the old worker's stream ends: d1 closed it
        entry = await _wait_engine(router, "d1", lambda e: e["state"] == "ejected", 20)
        assert entry["ejections"] == 1 and entry["last_failure"]["reason"] == "engine_disconnect"
        p0 = next(e for e in (await admin(router))["engines"] if e["name"] == "p0")
        assert (p0["state"], p0["failure_streak"], p0["ejections"]) == ("admitted", 0, 0)
    finally:
        router.stop()
        os.unlink(config)


def _names(router: RouterProcess) -> list[str]:
    status, body = http_get(router.url + "/admin/engines", headers=AUTH)
    return [] if status != 200 else [e["name"] for e in orjson.loads(body)["engines"]]


async def _wait_engine(router: RouterProcess, name: str, done: Any, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    entry: dict[str, Any] = {}
    while time.monotonic() < end:
        entry = next(e for e in (await admin(router))["engines"] if e["name"] == name)
        if done(entry):
            return entry
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name}: {entry}")
