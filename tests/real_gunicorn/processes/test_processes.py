"""The router's processes under real gunicorn (docs/behaviour.md "Processes", docs/operations.md "Following a request").

* every kill of what is not a worker ends with a supervisor running again, found by its
  title, that does the supervisor's work (operator actions, ejections), with the workers
  untouched and nothing left behind once the router stops;
* each process names its role in its title;
* the engine-state gauge follows an admin action within 0.5 s;
* gunicorn's ``--workers`` above the layout's default slot count wins, and every worker it
  runs reports into shared memory (a failure seen by each of them adds up to one ejection).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess, children_of, process_title, router_roles
from tests.real_gunicorn.fixtures import router_fixture
from tests.real_gunicorn.support import (
    TOKEN,
    admin,
    completion,
    engine_entry,
    post,
    send,
    sessions_per_worker,
    start_router,
    unique_prompt,
    wait_state,
    wait_until,
)

ENGINES = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
EJECT_AFTER = 2


SECTIONS: dict[str, Any] = {
    "server": {"workers": 2, "admin_token": TOKEN},
    "recovery": {"eject_after": EJECT_AFTER, "readmit_interval_s": 60, "readmit_interval_max_s": 60},
}


@pytest.fixture
def router(fleet: FakeFleet, tmp_path: Any) -> Iterator[RouterProcess]:
    """A router of the test's own: the tests that kill, wedge or stop its processes."""
    proc = start_router(fleet, [dict(e) for e in ENGINES], tmp_path, **SECTIONS)
    yield proc
    proc.stop()


# The same router, once for the tests that leave it as they found it (they only read its
# processes' titles, or eject an engine and readmit it): one start and stop fewer.
calm_router = router_fixture(ENGINES, "p2 → d2, as ``router``: shared by the tests that change nothing.", **SECTIONS)


def _supervisor(router: RouterProcess) -> int | None:
    found = router_roles(router.proc.pid)["supervisor"]
    return found[0] if len(found) == 1 else None


def _non_workers(router: RouterProcess) -> list[int]:
    """Every process under the master that is not a worker, grandchildren included."""
    roles = router_roles(router.proc.pid)
    top = roles["supervisor"] + roles["other"]
    below = [g for pid in children_of(router.proc.pid) for g in children_of(pid)]
    return top + below


async def _the_supervisor_works(router: RouterProcess) -> None:
    """An admin drain takes effect, and an engine failing EJECT_AFTER times is ejected."""
    entry = await admin(router, "POST", "/admin/engines/d2/drain")
    assert entry["state"] == "draining"
    assert (await engine_entry(router, "d2"))["state"] == "draining"
    await admin(router, "POST", "/admin/engines/d2/readmit")
    await wait_state(router, "d2", "admitted", timeout=5)
    for _ in range(EJECT_AFTER):
        failing = completion(unique_prompt(), fake={"prefill": {"status": 500}})
        assert (await send(router.url, "/v1/completions", failing)).status == 502
    entry = await wait_state(router, "p2", "ejected", timeout=5)
    assert entry["failure_streak"] == EJECT_AFTER and entry["last_failure"]["reason"] == "engine_5xx"
    await admin(router, "POST", "/admin/engines/p2/readmit")
    await wait_state(router, "p2", "admitted", timeout=5)


async def _kill_three_times(router: RouterProcess, victims: Any) -> set[int]:
    workers = set(router_roles(router.proc.pid)["worker"])
    assert len(workers) == 2
    seen: set[int] = set()
    for round_ in range(3):
        old = _supervisor(router)
        assert old is not None, router_roles(router.proc.pid)
        seen.add(old)
        targets = victims(router)
        assert old in targets
        for pid in targets:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda old=old: _supervisor(router) not in (None, old), 5, f"a new supervisor (round {round_ + 1})")
        await _the_supervisor_works(router)
    seen.add(_supervisor(router) or 0)
    assert set(router_roles(router.proc.pid)["worker"]) == workers  # never restarted
    reply = await send(router.url, "/v1/completions", completion(unique_prompt()))
    assert reply.status == 200
    return seen


def _stop_and_check_nothing_outlives(router: RouterProcess, pids: set[int], shm_before: set[str]) -> None:
    assert router.stop() == 0
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 10, "every router process gone")
    assert set(os.listdir("/dev/shm")) == shm_before


async def test_sigkill_of_the_supervisor_three_times_ends_with_a_working_one(router: RouterProcess) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    seen = await _kill_three_times(router, lambda r: [_supervisor(r)])
    _stop_and_check_nothing_outlives(router, seen | set(router_roles(router.proc.pid)["worker"]), shm_before)


async def test_sigkill_of_every_non_worker_process_at_once_three_times(router: RouterProcess) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    seen = await _kill_three_times(router, _non_workers)
    _stop_and_check_nothing_outlives(router, seen | set(router_roles(router.proc.pid)["worker"]), shm_before)


async def test_a_wedged_supervisor_is_replaced_and_said_so_in_json_like_every_other_line(
    router: RouterProcess,
) -> None:
    wait_until(lambda: _supervisor(router) is not None, 5, "the supervisor titled")
    old = _supervisor(router)
    assert old is not None
    os.kill(old, signal.SIGSTOP)  # alive, but its loop beats no more
    wait_until(lambda: _supervisor(router) not in (None, old), 15, "a new supervisor after the old one wedged")
    await _the_supervisor_works(router)
    lines = [line for line in router.log_text().splitlines() if "stopped beating" in line]
    assert len(lines) == 1, lines
    entry = json.loads(lines[0])  # the log format is json: this line too is one JSON object
    assert set(entry) == {"ts", "level", "logger", "message"}
    assert (entry["level"], entry["logger"]) == ("error", "narwhal.supervisor")
    assert entry["message"] == f"supervisor {old} stopped beating; restarting it"


def test_every_process_names_its_role(calm_router: RouterProcess) -> None:
    router = calm_router
    master = router.proc.pid
    wait_until(lambda: _supervisor(router) is not None, 5, "the supervisor titled")
    roles = router_roles(master)
    assert process_title(master).startswith("gunicorn: master [narwhal]")
    assert [process_title(pid) for pid in roles["worker"]] == ["gunicorn: worker [narwhal]"] * 2
    assert [process_title(pid) for pid in roles["supervisor"]] == ["narwhal: supervisor"]
    assert roles["other"] == []


async def test_the_engine_state_gauge_follows_an_ejection_within_half_a_second(calm_router: RouterProcess) -> None:
    router = calm_router
    sample = 'narwhal_engine_state{engine="d2",role="consumer"} %s'
    assert sample % "0.0" in http_get(router.url + "/metrics")[1].decode()
    await admin(router, "POST", "/admin/engines/d2/eject")
    try:
        acted = time.monotonic()
        wait_until(lambda: sample % "2.0" in http_get(router.url + "/metrics")[1].decode(), 0.5,
                   "narwhal_engine_state of d2 at 2 (ejected)")
        assert time.monotonic() - acted < 0.5
    finally:
        await admin(router, "POST", "/admin/engines/d2/readmit")
    wait_until(lambda: sample % "0.0" in http_get(router.url + "/metrics")[1].decode(), 0.5,
               "narwhal_engine_state of d2 back at 0 (admitted)")


WORKERS_ABOVE_SLOTS = 9  # above the 8 slots server.workers = 2 used to give (now always 512)


async def test_gunicorn_workers_above_the_default_slots_all_report_to_the_supervisor(
    fleet: FakeFleet, tmp_path: Any
) -> None:
    router = start_router(
        fleet, [dict(e) for e in ENGINES], tmp_path, gunicorn_args=("--workers", str(WORKERS_ABOVE_SLOTS)),
        server={"workers": 2, "admin_token": TOKEN},
        recovery={"eject_after": WORKERS_ABOVE_SLOTS, "readmit_interval_s": 60, "readmit_interval_max_s": 60},
    )
    try:
        assert "narwhal: gunicorn's --workers 9 overrides server.workers = 2" in router.log_text()
        async with sessions_per_worker(router, WORKERS_ABOVE_SLOTS) as sessions:
            for pid, session in sessions.items():  # one failure seen by each worker
                status, _ = await post(session, router, completion(unique_prompt(), fake={"prefill": {"status": 500}}))
                assert status == 502, pid
        # Only if every worker's report reached the supervisor does the streak reach 9.
        entry = await wait_state(router, "p2", "ejected", timeout=5)
        assert entry["failure_streak"] == WORKERS_ABOVE_SLOTS
        assert "no free worker slot" not in router.log_text()
    finally:
        router.stop()
