"""The master's supervisor keeper (narwhal.master.keeper.SupervisorKeeper) as a state machine:
when it takes its supervisor for wedged, when it restarts, when it escalates, with time as a
fake clock and real child processes standing in for the supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from narwhal.master import keeper
from narwhal.master.gunicorn_hooks import reconcile
from narwhal.master.keeper import MIN_RESPAWN_S, STALE_S, STARTUP_S, TERM_GRACE_S, SupervisorKeeper
from narwhal.settings import Settings
from narwhal.shm.shared import SharedFleet


@dataclass
class _Beats:
    supervisor_pid: int
    heartbeat_age_s: float
    starts: int = 0

    def count_start(self) -> int:
        self.starts += 1
        return self.starts


@dataclass
class _Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Children:
    """Stand-ins for forked supervisors: real processes, so pidfds and signals are real."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def fork(self, body: Any, *, death_signal: int, keep_fd: int) -> int:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.procs.append(proc)
        return proc.pid


@pytest.fixture
def children(monkeypatch: pytest.MonkeyPatch) -> Any:
    kids = _Children()
    monkeypatch.setattr(keeper, "fork_child", kids.fork)
    yield kids
    for proc in kids.procs:
        proc.kill()
        proc.wait()


def _keeper(beats: _Beats, clock: _Clock) -> SupervisorKeeper:
    shared = cast(Any, beats)
    shared.region = type("R", (), {"fd": -1})()
    return SupervisorKeeper(shared, clock=clock)


def _wait_stopped(pid: int) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"{pid} never stopped")


def _wait_exit(keeper: SupervisorKeeper, pid: int) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end and keeper.pid == pid:
        keeper.check()
        time.sleep(0.01)


def test_a_starting_supervisor_is_judged_by_its_own_first_beat_not_its_predecessors(children: _Children) -> None:
    clock, beats = _Clock(), _Beats(10, 60.0)
    keeper = _keeper(beats, clock)
    keeper.start()
    # The last beat is the killed predecessor's (pid 10), long stale: the new one is still
    # importing and restoring state on a loaded host, and must be left to start.
    clock.now += STALE_S * 3
    assert not keeper.wedged()
    clock.now += STARTUP_S
    assert keeper.wedged()


def test_a_supervisor_that_beat_and_stopped_is_killed_and_replaced(children: _Children) -> None:
    clock, beats = _Clock(), _Beats(0, 0.0)
    keeper = _keeper(beats, clock)
    keeper.start()
    first = keeper.pid
    beats.supervisor_pid, beats.heartbeat_age_s = first, STALE_S / 2
    keeper.check()
    assert keeper.pid == first and children.procs[0].poll() is None
    beats.heartbeat_age_s = STALE_S + 0.5
    clock.now += MIN_RESPAWN_S
    keeper.check()  # stale: its CPU time is sampled (a sleeping stand-in uses none)
    assert children.procs[0].poll() is None
    clock.now += STALE_S + 0.1
    keeper.check()  # no CPU used for STALE_S more: blocked, SIGKILL
    assert children.procs[0].wait(5) == -signal.SIGKILL
    _wait_exit(keeper, first)
    assert keeper.pid not in (0, first) and len(children.procs) == 2 and beats.starts == 2


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_the_stopped_beating_line_is_in_the_logs_format(
    children: _Children, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    monkeypatch.setattr("narwhal.logs.current", lambda: Settings.model_validate({"log": {"format": fmt}}))
    clock, beats = _Clock(), _Beats(0, 0.0)
    keeper = _keeper(beats, clock)
    keeper.start()
    beats.supervisor_pid, beats.heartbeat_age_s = keeper.pid, STALE_S + 0.5
    keeper.check()
    clock.now += STALE_S + 0.1
    keeper.check()
    err = capsys.readouterr().err.strip()
    message = f"supervisor {keeper.pid} stopped beating; restarting it"
    if fmt == "text":
        assert err == f"narwhal: {message}"
    else:  # one JSON object, like every other line of a json log
        line = json.loads(err)
        assert set(line) == {"ts", "level", "logger", "message"}
        assert (line["level"], line["logger"], line["message"]) == ("error", "narwhal.supervisor", message)


def test_a_late_beat_from_a_supervisor_that_runs_is_not_replaced(
    children: _Children, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A host starved by busy engines: the supervisor beats seconds late but still uses CPU.
    clock, beats = _Clock(), _Beats(0, 0.0)
    kept = _keeper(beats, clock)
    kept.start()
    ticks = iter(range(100, 10_000, 7))
    monkeypatch.setattr(keeper, "cpu_ticks", lambda pid: next(ticks))
    beats.supervisor_pid, beats.heartbeat_age_s = kept.pid, STALE_S + 2
    for _ in range(10):
        assert not kept.wedged()
        clock.now += STALE_S
    assert "but is running: not replaced" in capsys.readouterr().err
    beats.heartbeat_age_s = keeper.HARD_STALE_S + 1  # the bound for a loop that spins without beating
    assert kept.wedged()
    beats.heartbeat_age_s = 0.1
    assert not kept.wedged()
    monkeypatch.setattr(keeper, "cpu_ticks", lambda pid: 500)  # now blocked: no CPU at all
    beats.heartbeat_age_s = STALE_S + 1
    assert not kept.wedged()
    clock.now += STALE_S + 0.1
    assert kept.wedged()


def test_cpu_ticks_reads_this_process() -> None:
    first = keeper.cpu_ticks(os.getpid())
    sum(i * i for i in range(3_000_000))
    assert first is not None and (keeper.cpu_ticks(os.getpid()) or 0) > first
    assert keeper.cpu_ticks(2**22 + 12345) is None


def test_a_beat_writes_its_time_before_its_pid() -> None:
    # A keeper that sees the new pid must see the new beat: the predecessor's would be stale.
    shared = SharedFleet.create(engines=1, slots=1)
    try:
        seen: list[float] = []
        real = shared.region.set_u32

        def set_u32(offset: int, value: int) -> None:
            seen.append(shared.heartbeat_age_s)
            real(offset, value)

        shared.region.set_u32 = set_u32  # type: ignore[method-assign]
        shared.beat(4242)
        assert shared.supervisor_pid == 4242 and len(seen) == 1 and seen[0] < 1.0
    finally:
        shared.close()


def test_a_killed_supervisor_is_restarted_but_a_crash_loop_is_slowed(children: _Children) -> None:
    clock, beats = _Clock(), _Beats(0, 0.0)
    keeper = _keeper(beats, clock)
    keeper.start()
    first = keeper.pid
    os.kill(first, signal.SIGKILL)
    children.procs[0].wait(5)
    keeper.check()  # gone, but started less than MIN_RESPAWN_S ago: not yet
    assert keeper.pid == 0 and len(children.procs) == 1
    clock.now += MIN_RESPAWN_S
    keeper.check()
    assert keeper.pid not in (0, first) and len(children.procs) == 2


def test_a_reload_stops_the_supervisor_and_escalates_if_it_does_not_go(children: _Children) -> None:
    clock, beats = _Clock(), _Beats(0, 0.0)
    keeper = _keeper(beats, clock)
    keeper.start()
    first = keeper.pid
    beats.supervisor_pid = first
    signal_ignored = children.procs[0]
    os.kill(first, signal.SIGSTOP)  # a stopped process does not act on SIGTERM …
    _wait_stopped(first)  # … once it is stopped: a SIGTERM still pending beside SIGSTOP goes first
    keeper.reload()
    keeper.check()
    assert keeper.pid == first
    clock.now += TERM_GRACE_S + 0.1
    keeper.check()
    assert signal_ignored.wait(5) == -signal.SIGKILL
    _wait_exit(keeper, first)  # restarted at once: a reload is not a crash loop
    assert keeper.pid not in (0, first)


def test_stop_ends_the_supervisor_and_nothing_restarts_it(children: _Children) -> None:
    clock, beats = _Clock(), _Beats(0, 0.0)
    keeper = _keeper(beats, clock)
    keeper.start()
    proc = children.procs[0]
    keeper.stop()
    # keeper.stop() reaps the child itself when it is quick (waitpid: gunicorn no longer reaps
    # while exiting); Popen then finds no child to wait for and says 0. Either way it is gone,
    # ended by the SIGTERM: it would otherwise sleep its 60 s.
    assert proc.wait(5) in (-signal.SIGTERM, 0)
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    clock.now += 60
    keeper.check()
    assert keeper.pid == 0 and len(children.procs) == 1


@dataclass
class _Cfg:
    workers: int
    bind: list[str]
    graceful_timeout: int


def test_gunicorn_options_win_and_every_process_sees_them() -> None:
    settings = Settings.model_validate({"server": {"workers": 2, "bind": "127.0.0.1:9000", "graceful_timeout_s": 30}})
    same, lines = reconcile(settings, _Cfg(2, ["127.0.0.1:9000"], 30))
    assert same is settings and lines == []
    moved, lines = reconcile(settings, _Cfg(16, ["0.0.0.0:8100"], 45))
    assert (moved.server.workers, moved.server.bind, moved.server.graceful_timeout_s) == (16, "0.0.0.0:8100", 45.0)
    assert lines == [
        "narwhal: gunicorn's --workers 16 overrides server.workers = 2",
        "narwhal: gunicorn's --bind 0.0.0.0:8100 overrides server.bind = '127.0.0.1:9000'",
        "narwhal: gunicorn's --graceful-timeout 45 overrides server.graceful_timeout_s = 30.0",
    ]


def test_a_reload_that_leaves_a_new_worker_without_a_slot_is_refused_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from narwhal import shm
    from narwhal.master import gunicorn_hooks
    from narwhal.settings import SettingsError

    shared = SharedFleet.create(engines=1, slots=6, ring=1)
    monkeypatch.setattr(shm, "SHARED", shared)
    try:
        for _ in range(2):
            shared.claim_slot(1)  # two workers running (pid 1 is alive)
        gunicorn_hooks._check_room(Settings.model_validate({"server": {"workers": 4}}))  # 2 + 4 fit
        with pytest.raises(SettingsError) as exc:
            gunicorn_hooks._check_room(Settings.model_validate({"server": {"workers": 5}}))
        assert str(exc.value) == ("server.workers: 5 new workers beside the 2 running ones exceed the shared "
                                  "layout's 6 worker slots")
    finally:
        shared.close()


def test_the_layout_has_a_slot_for_every_worker_of_any_reload_within_the_limit() -> None:
    from narwhal.settings import MAX_WORKERS
    from narwhal.shm.layout import WORKER_SLOTS

    assert WORKER_SLOTS == 512 == 2 * MAX_WORKERS
    with pytest.raises(ValueError, match="less than or equal to 256"):
        Settings.model_validate({"server": {"workers": MAX_WORKERS + 1}})
