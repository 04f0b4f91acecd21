"""Signals and worker recycling under real gunicorn (docs/behaviour.md "Processes" "Signals", issue: graceful
lifecycle).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from typing import Any

import aiohttp
import orjson
import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess, children_of, router_roles, write_config
from tests.real_gunicorn.support import (
    TIMEOUTS,
    Reply,
    completion,
    send,
    settled,
    start_router,
    terminal_error,
    unique_prompt,
    wait_until,
)

ENGINES = [{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"}]


def workers_of(router: RouterProcess) -> set[int]:
    """Live workers: the master's children that gunicorn booted as workers (its log names them)."""
    booted = {int(pid) for pid in re.findall(r"Booting worker with pid: (\d+)", router.log_text())}
    return booted & set(children_of(router.proc.pid))


def engines(fleet: FakeFleet) -> list[dict[str, Any]]:
    return [dict(e) for e in ENGINES]


async def stream_with_signal(router: RouterProcess, body: dict, sig: int, after_s: float = 0.3) -> Reply:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(router.url + "/v1/completions", json=body)
        assert resp.status == 200
        first = await resp.content.readany()
        await asyncio.sleep(after_s)
        os.kill(router.proc.pid, sig)
        return Reply(resp.status, resp.headers, first + await resp.read())


async def test_sigterm_lets_a_stream_finish_and_exits_cleanly(fleet: FakeFleet, tmp_path: Any) -> None:
    router = start_router(fleet, engines(fleet), tmp_path, server={"graceful_timeout_s": 10})
    try:
        body = completion(unique_prompt(), max_tokens=20, fake={"decode": {"token_delay_s": 0.05}})
        reply = await stream_with_signal(router, body, signal.SIGTERM)
        assert reply.events[-1] == b"[DONE]"
        assert len(reply.events) == 21
        assert router.proc.wait(15) == 0
    finally:
        router.stop()


async def test_sigterm_ends_a_stream_that_outlives_the_graceful_timeout_with_an_event(
    fleet: FakeFleet, tmp_path: Any
) -> None:
    router = start_router(fleet, engines(fleet), tmp_path, server={"graceful_timeout_s": 2})
    try:
        body = completion(unique_prompt(), max_tokens=200, fake={"decode": {"token_delay_s": 0.05}})
        started = time.monotonic()
        reply = await stream_with_signal(router, body, signal.SIGTERM, after_s=0.1)
        assert time.monotonic() - started < 8  # ended at 85 % of the 2 s graceful timeout, not cut later
        err = terminal_error(reply)
        assert err == {"message": "the router is shutting down", "type": "shutting_down", "param": None, "code": 503}
        assert router.proc.wait(15) == 0
    finally:
        router.stop()


async def test_sighup_reloads_settings_without_dropping_a_stream(fleet: FakeFleet, tmp_path: Any) -> None:
    conf = {"engine": dict(TIMEOUTS), "preflight": {"on_start": False}, "log": {"access_log": "", "level": "info"}}
    config = write_config([{**e, "url": fleet.engines[e["name"]]} for e in ENGINES], conf)
    router = RouterProcess.start(config, log_path=str(tmp_path / "router.log"))
    try:
        old_workers = workers_of(router)
        # The new settings: client keys are now required.
        with open(config, "a") as f:
            f.write('\n[server]\napi_keys = ["k1"]\n')
        body = completion(unique_prompt(), max_tokens=30, fake={"decode": {"token_delay_s": 0.05}})
        reply = await stream_with_signal(router, body, signal.SIGHUP, after_s=0.1)
        assert reply.events[-1] == b"[DONE]" and len(reply.events) == 31
        wait_until(lambda: not (old_workers & workers_of(router)), 15, "old workers replaced")
        assert "narwhal: reload: changed server.api_keys" in router.log_text()  # what changed, secrets unshown
        assert "k1" not in router.log_text()
        denied = await send(router.url, "/v1/completions", completion(unique_prompt()))
        assert denied.status == 401
        allowed = await send(router.url, "/v1/completions", completion(unique_prompt()),
                             headers={"Authorization": "Bearer k1"})
        assert allowed.status == 200
        # A broken file on the next reload keeps the running settings (and the router).
        reloaded = workers_of(router)
        with open(config, "a") as f:
            f.write("\n[bogus]\nx = 1\n")
        os.kill(router.proc.pid, signal.SIGHUP)
        wait_until(lambda: "reload refused" in router.log_text(), 10, "the refused reload logged")
        # Refused before gunicorn replaces anything: the same workers serve, on the kept settings.
        assert "reload refused, keeping the running settings and workers: bogus" in router.log_text()
        assert workers_of(router) == reloaded
        assert (await send(router.url, "/v1/completions", completion(unique_prompt()))).status == 401
        assert (await send(router.url, "/v1/completions", completion(unique_prompt()),
                           headers={"Authorization": "Bearer k1"})).status == 200
    finally:
        router.stop()
        os.unlink(config)


async def test_sigterm_while_a_worker_boots_stops_the_router_without_the_graceful_timeout(
    fleet: FakeFleet, tmp_path: Any
) -> None:
    """SIGTTIN, then SIGTERM as soon as the master has forked the new worker: the worker is
    signalled while it still boots (gunicorn's fork, then aiohttp's and the app's imports, before
    its loop runs). The signal used to be lost there, and the master waited out the graceful
    timeout (60 s here) before killing the worker."""
    router = start_router(fleet, engines(fleet), tmp_path, server={"workers": 1, "graceful_timeout_s": 60},
                          log={"level": "info", "access_log": ""})
    try:
        first = workers_of(router)
        before = set(children_of(router.proc.pid))
        # Not both at once: pending together, CPython runs the handlers by signal number, SIGTERM first.
        os.kill(router.proc.pid, signal.SIGTTIN)
        end = time.monotonic() + 10
        while not set(children_of(router.proc.pid)) - before:  # polled tightly: the boot lasts a fraction of a second
            assert time.monotonic() < end, "the master forked no worker for SIGTTIN"
            time.sleep(0.001)
        os.kill(router.proc.pid, signal.SIGTERM)
        assert router.proc.wait(20) == 0
        log = router.log_text()
        booted = set(re.findall(r"Booting worker with pid: (\d+)", log))
        assert len(booted) == 2 and {str(pid) for pid in first} < booted
        assert set(re.findall(r"Worker exiting \(pid: (\d+)\)", log)) == booted
    finally:
        router.stop()


def _sample(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


@pytest.mark.timeout(120)
async def test_worker_recycling_keeps_counts_and_shared_state_right(fleet: FakeFleet, tmp_path: Any) -> None:
    router = start_router(fleet, engines(fleet), tmp_path, gunicorn_args=("--max-requests", "4"),
                          server={"workers": 2, "admin_token": "t"}, log={"level": "info", "access_log": ""})
    try:
        first = workers_of(router)

        async def served() -> int:
            try:
                reply = await send(router.url, "/v1/completions", completion(unique_prompt()))
            except aiohttp.ClientConnectionError:
                # A connection accepted by a worker in the instant it retires (max_requests) can
                # be closed before its request is read: never handled, so never counted either.
                return 0
            assert reply.status == 200
            return 1

        # Keep the traffic coming until both original workers were recycled (gunicorn checks
        # max_requests once a second per worker), in batches of concurrent requests so that
        # connections arrive while a worker retires: one it had just accepted used to wait out
        # the graceful timeout (28.5 s) and be dropped (tests/unit/worker/test_accept_stop.py).
        n = 0
        end = time.monotonic() + 60
        while len(workers_of(router) - first) < 2 or first & workers_of(router):
            assert time.monotonic() < end, "workers were not recycled"
            n += sum(await asyncio.gather(*(served() for _ in range(6))))
            await asyncio.sleep(0.1)

        def counts() -> tuple[float, float]:
            text = http_get(router.url + "/metrics")[1].decode()
            served = r'narwhal_requests_total\{code="200",endpoint="/v1/completions",model="[^"]*"\} ([0-9.]+)'
            return (_sample(text, served),
                    _sample(text, r"narwhal_first_byte_seconds_count ([0-9.]+)"))

        # Counted just after each response went out: a scrape may be a moment early.
        assert settled(counts, (n, n)) == (n, n)

        def inflight() -> list[dict[str, int]]:
            _, body = http_get(router.url + "/admin/engines", headers={"Authorization": "Bearer t"})
            return [entry["inflight"] for entry in orjson.loads(body)["engines"]]

        idle = [{"prefill": 0, "decode": 0}] * len(inflight())
        assert settled(inflight, idle) == idle
    finally:
        router.stop()


async def test_sigterm_to_the_whole_process_group_starts_no_supervisor_on_the_way_out(
    fleet: FakeFleet, tmp_path: Any
) -> None:
    """systemd's default ``KillMode=control-group`` signals every process of the unit at once: the
    supervisor exits on its own SIGTERM while the master drains its workers. The master used to
    fork a new supervisor from that drain, which ran engine discovery after "Shutting down"."""
    router = start_router(fleet, engines(fleet), tmp_path, log={"level": "info", "access_log": ""})
    try:
        wait_until(lambda: len(router_roles(router.proc.pid)["supervisor"]) == 1, 10, "the supervisor titled")
        seen = set(router_roles(router.proc.pid)["supervisor"])
        first = set(seen)
        os.killpg(router.proc.pid, signal.SIGTERM)
        end = time.monotonic() + 20
        # Polled tightly: a supervisor forked in the drain lives until on_exit, a few tenths of a second.
        while router.proc.poll() is None:
            assert time.monotonic() < end, "the router did not exit within 20 s"
            seen |= set(router_roles(router.proc.pid)["supervisor"])
            time.sleep(0.002)
        assert router.proc.returncode == 0
        assert seen == first
    finally:
        router.stop()
