"""Admin-API and per-worker helpers shared by the supervisor and recovery tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp

from narwhal.harness import RouterProcess
from tests.integration.helpers import send

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def admin(router: RouterProcess, method: str = "GET", path: str = "/admin/engines") -> dict:
    reply = await send(router.url, path, method=method, headers=AUTH)
    assert reply.status == 200, reply.raw
    return reply.json


async def engine_entry(router: RouterProcess, name: str) -> dict:
    return next(e for e in (await admin(router))["engines"] if e["name"] == name)


async def wait_state(router: RouterProcess, name: str, state: str, timeout: float = 10) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        entry = await engine_entry(router, name)
        if entry["state"] == state:
            return entry
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} never became {state}: {entry}")


async def readmit_all(router: RouterProcess, names: list[str]) -> None:
    for name in names:
        await admin(router, "POST", f"/admin/engines/{name}/readmit")


@contextlib.asynccontextmanager
async def sessions_per_worker(router: RouterProcess, workers: int) -> AsyncIterator[dict[int, aiohttp.ClientSession]]:
    """One keep-alive session per worker, keyed by the worker's pid.

    A connection stays with the worker that accepted it, and ``/health`` names that worker.
    """
    sessions: dict[int, aiohttp.ClientSession] = {}
    spare: list[aiohttp.ClientSession] = []
    end = time.monotonic() + 20
    try:
        while len(sessions) < workers and time.monotonic() < end:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with session.get(router.url + "/health") as resp:
                pid = (await resp.json())["worker"]
            if pid in sessions:
                spare.append(session)
            else:
                sessions[pid] = session
        assert len(sessions) == workers, f"could not reach {workers} workers"
        yield sessions
    finally:
        for session in [*sessions.values(), *spare]:
            await session.close()


async def post(session: aiohttp.ClientSession, router: RouterProcess, body: dict) -> tuple[int, bytes]:
    async with session.post(router.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


