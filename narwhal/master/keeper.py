"""Starting, watching and restarting the supervisor from the gunicorn master.

Invariant: while the master lives, a supervisor is running or is restarted within about a
second — whatever killed the previous one (docs/behaviour.md "Processes"). Only the master can promise that: any
process below it can be OOM-killed, and a watcher that is itself killed watches nothing (the
previous design forked a watchdog that forked the supervisor; a SIGKILL of the watchdog
took the supervisor with it, for good). So the master watches the supervisor itself.

How the master watches without a periodic hook of its own: gunicorn's main loop calls
``Arbiter.manage_workers`` at least once a second and right after every signal (SIGCHLD
included), so ``narwhal.master.gunicorn_hooks`` wraps that method of the running arbiter to call
:meth:`SupervisorKeeper.check` (and ``reap_workers``, the only call in a reload's wait for the
old workers, which lasts as long as their streams: the supervisor a reload stops is replaced
at once, not after that wait). gunicorn reaps every child with ``waitpid(-1)`` (an unknown
pid is reaped and forgotten), so the keeper cannot ``waitpid`` its child; it learns of the
exit from a **pidfd** (``pidfd_open``, exact even after the reap and immune to pid reuse),
falling back to ``kill(pid, 0)`` where pidfds are missing. A supervisor whose heartbeat in
shared memory goes stale (a wedged event loop) is killed and replaced the same way.

An overloaded supervisor is not a wedged one. On a host starved by busy engines a live
supervisor can beat seconds late; replacing it then loses its state and costs a restart's work
on the same starved host (three restarts in four minutes were seen beside real CPU engines). So
a stale beat alone is not enough: the keeper also reads the supervisor's CPU time
(``/proc/<pid>/stat``). One that is still using CPU is running, only slowly: it is left alone
(said once) until its beat is :data:`HARD_STALE_S` old, the bound for a loop that spins without
beating. One that used no CPU for :data:`STALE_S` more is blocked: replaced.

Deliberately left out: a master thread (``PR_SET_PDEATHSIG`` fires when the forking *thread*
ends) and ``multiprocessing`` (its atexit hook in the first worker that exits terminates a
daemonic child). ``os.fork`` from the master's main thread is all it takes: the child closes
every inherited descriptor but stdio and the shared memory (never a listening socket), dies
with the master (``PR_SET_PDEATHSIG`` plus a ``getppid`` check), and names itself in ``ps``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable

from narwhal.logs import master_line
from narwhal.shm.shared import SharedFleet
from narwhal.supervisor.process import run_supervisor, set_parent_death_signal

STALE_S = 3.0  # heartbeat age after which a supervisor's CPU time decides (module text)
HARD_STALE_S = 30.0  # heartbeat age after which it is replaced whatever its CPU time says
# A new supervisor imports, loads settings and restores state before its first beat; on a
# loaded host that can take longer than STALE_S, and the old one's beat says nothing about it.
STARTUP_S = 30.0
TERM_GRACE_S = 3.0  # a supervisor asked to stop (reload, shutdown) that is still there is killed
# A supervisor that dies at once (say, its settings no longer load) is restarted no faster
# than this: a crash loop must not fork as fast as SIGCHLD can wake the master.
MIN_RESPAWN_S = 1.0


class SupervisorKeeper:
    """The master's handle on its supervisor: start, check (every master loop), reload, stop."""

    def __init__(self, shared: SharedFleet, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.shared = shared
        self.clock = clock
        self.pid = 0
        self._pidfd = -1
        self.started_at = 0.0
        self._term_sent_at: float | None = None
        self._stale_since: tuple[float, int | None] | None = None  # (when, CPU ticks) at the first stale look
        self._said_slow = False
        self.stopping = False  # the master is on its way out: nothing is restarted or killed from check()

    # -- the master's calls ----------------------------------------------------------------

    def start(self) -> None:
        """Master only: fork a supervisor (told it is a restart after the first) and watch its pidfd."""
        starts = self.shared.count_start()
        pid = fork_child(lambda: run_supervisor(self.shared, restarted=starts > 1), death_signal=signal.SIGTERM,
                         keep_fd=self.shared.region.fd)
        self.pid, self.started_at, self._term_sent_at = pid, self.clock(), None
        self._stale_since, self._said_slow = None, False
        self._pidfd = _pidfd_open(pid)

    def check(self) -> None:
        """Restart a supervisor that is gone, kill one that is wedged or will not stop."""
        if self.stopping:
            return
        if self.pid and self._exited():
            self._forget()
        if not self.pid:
            if self.clock() - self.started_at >= MIN_RESPAWN_S:
                self.start()
            return
        now = self.clock()
        if self._term_sent_at is not None:
            if now - self._term_sent_at > TERM_GRACE_S:
                self._signal(signal.SIGKILL)
        elif self.wedged():
            line = master_line("error", "narwhal.supervisor", f"supervisor {self.pid} stopped beating; restarting it")
            print(line, file=sys.stderr, flush=True)
            self._signal(signal.SIGKILL)

    def reload(self) -> None:
        """SIGHUP: the running supervisor stops; :meth:`check` starts one on the new settings."""
        if self.pid and self._term_sent_at is None:
            self._term_sent_at = self.clock()
            self.started_at = 0.0  # a reload is not a crash loop: restart as soon as it is gone
            self._signal(signal.SIGTERM)

    def stop(self, timeout: float = 5.0) -> None:
        """Master only, for good: SIGTERM, reap within ``timeout``, then SIGKILL; the keeper restarts nothing after."""
        self.stopping = True
        if not self.pid:
            return
        self._signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self._exited():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, os.WNOHANG)  # gunicorn no longer reaps once it is exiting
            time.sleep(0.02)
        if not self._exited():
            self._signal(signal.SIGKILL)
        self._forget()

    # -- state -----------------------------------------------------------------------------

    def wedged(self) -> bool:
        """Alive but not looping, to be replaced: no first beat for ``STARTUP_S``; or a beat older
        than ``STALE_S`` and no CPU used for ``STALE_S`` more; or a beat older than ``HARD_STALE_S``."""
        if self.shared.supervisor_pid != self.pid:  # this one has not beaten yet
            return self.clock() - self.started_at > STARTUP_S
        age = self.shared.heartbeat_age_s
        if age <= STALE_S:
            self._stale_since, self._said_slow = None, False
            return False
        if age > HARD_STALE_S:
            return True
        return not self._still_running(age)

    def _still_running(self, age: float) -> bool:
        """A stale beat: has the supervisor used CPU since the first stale look (or that look is
        under ``STALE_S`` old)? Unreadable CPU time leaves the beat alone to decide, as before."""
        now, ticks = self.clock(), cpu_ticks(self.pid)
        if self._stale_since is None:
            self._stale_since = (now, ticks)
            return True
        since, before = self._stale_since
        if ticks is not None and before is not None and ticks > before:  # slow, not wedged
            self._stale_since = (now, ticks)
            if not self._said_slow:
                self._said_slow = True
                line = master_line("warning", "narwhal.supervisor",
                                   f"supervisor {self.pid} beats late ({age:.1f}s) but is running: not replaced")
                print(line, file=sys.stderr, flush=True)
            return True
        return now - since <= STALE_S

    def _exited(self) -> bool:
        if self._pidfd >= 0:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            return bool(readable)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        return False

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def _forget(self) -> None:
        pid, self.pid = self.pid, 0
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if pid and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Its live gauges must not linger or double beside its successor's.
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def _pidfd_open(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): kill(pid, 0) instead
        return -1


def fork_child(body: Callable[[], None], *, death_signal: int, keep_fd: int) -> int:
    """Fork; in the child run ``body`` and exit — it must never return into gunicorn's
    arbiter. Returns the child's pid to the parent."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        _reset_signals()
        set_parent_death_signal(death_signal)
        _close_inherited_fds(keep=keep_fd)
        if os.getppid() == parent:  # else the parent died before the death signal was armed
            body()
    except BaseException:  # noqa: BLE001 - whatever happens, the child ends here
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _close_inherited_fds(keep: int) -> None:
    """Keep only stdio and the shared memory: never a listening socket the master holds, so
    the supervisor never holds the port."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            with contextlib.suppress(OSError):  # the descriptor listdir itself used, closed
                os.close(fd)


def _reset_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGWINCH, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_DFL)


def cpu_ticks(pid: int) -> int | None:
    """The CPU time ``pid`` used so far (user + system, in clock ticks); None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold spaces
    try:
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of the whole line
    except (IndexError, ValueError):
        return None
