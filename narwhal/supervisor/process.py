"""Starting, watching and restarting the supervisor under gunicorn.

gunicorn has no periodic master hook, and its arbiter reaps *every* child with
``waitpid(-1)``, so the master can neither poll a child it forked nor learn its exit status.
So the master forks one small **watchdog** in ``on_starting`` (before the listening sockets
exist: neither process ever holds the port), and the watchdog forks the supervisor as *its*
child, which it can wait for. The watchdog restarts the supervisor within a second when it
exits, and kills and restarts it when its heartbeat in shared memory goes stale (a wedged
event loop). ``os.fork`` is used rather than ``multiprocessing``: a daemonic Process is
terminated by multiprocessing's atexit hook in the first worker that exits.

Lifetimes: the watchdog dies with the master (``PR_SET_PDEATHSIG`` plus a ``getppid`` poll),
the supervisor with the watchdog. ``SIGHUP`` to the watchdog (sent by the master's
``on_reload``) restarts the supervisor on freshly loaded settings. Each restart marks the
previous supervisor dead for prometheus, so its live gauges do not linger or double.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

from narwhal.shm.shared import SharedFleet

PR_SET_PDEATHSIG = 1
STALE_S = 3.0  # heartbeat age after which a running supervisor is presumed wedged
# A new supervisor imports, loads settings and restores state before its first beat; on a
# loaded host that can take longer than STALE_S, and the old one's beat says nothing about it.
STARTUP_S = 30.0
POLL_S = 0.1


def set_parent_death_signal(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the getppid poll still ends us
        pass


def start_watchdog(shared: SharedFleet) -> int:
    """Fork the watchdog from the gunicorn master; return its pid."""
    master = os.getpid()

    def body() -> None:
        _close_inherited_fds(keep=shared.region.fd)
        Watchdog(shared, master).run()

    return _fork(body, death_signal=signal.SIGTERM)


def _fork(body: Callable[[], None], *, death_signal: int) -> int:
    """Fork; in the child run ``body`` and exit — it must never return into the parent's code
    (gunicorn's arbiter, or the watchdog's loop). Returns the child's pid to the parent."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        _reset_signals()
        set_parent_death_signal(death_signal)
        if os.getppid() == parent:  # else the parent died before the death signal was armed
            body()
    except BaseException:  # noqa: BLE001 - whatever happens, the child ends here
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _close_inherited_fds(keep: int) -> None:
    """Keep only stdio and the shared memory: in particular never a listening socket the
    master was handed (``fd://N``), so the watchdog and the supervisor never hold the port."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor listdir itself used, already closed


def _reset_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGWINCH, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_DFL)


class Watchdog:
    def __init__(self, shared: SharedFleet, master: int) -> None:
        self.shared = shared
        self.master = master
        self.stopping = False
        self.reload = False
        self.child = 0
        self.started_at = 0.0

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGQUIT, self._stop)
        signal.signal(signal.SIGHUP, self._reload)
        self._spawn()
        while not self.stopping and os.getppid() == self.master:
            time.sleep(POLL_S)
            exited = self._reap()
            if self.reload:
                self.reload = False
                self._kill(signal.SIGTERM)
                exited = True
            elif not exited and self._wedged():
                print(f"narwhal: supervisor {self.child} stopped beating; restarting it", file=sys.stderr)
                self._kill(signal.SIGKILL)
                exited = True
            if exited and not self.stopping:
                self._spawn()
        self._kill(signal.SIGTERM)

    def _wedged(self) -> bool:
        if self.shared.supervisor_pid != self.child:  # this one has not beaten yet
            return time.monotonic() - self.started_at > STARTUP_S
        return self.shared.heartbeat_age_s > STALE_S

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _reload(self, *_: object) -> None:
        self.reload = True

    def _reap(self) -> bool:
        if not self.child:
            return True
        try:
            pid, _ = os.waitpid(self.child, os.WNOHANG)
        except ChildProcessError:
            pid = self.child
        if pid:
            self._forget(pid)
            return True
        return False

    def _forget(self, pid: int) -> None:
        self.child = 0
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]

    def _kill(self, sig: int) -> None:
        if not self.child:
            return
        pid = self.child
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self._forget(pid)
                return
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        self._forget(pid)

    def _spawn(self) -> None:
        starts = self.shared.count_start()
        self.child = _fork(lambda: run_supervisor(self.shared, restarted=starts > 1), death_signal=signal.SIGKILL)
        self.started_at = time.monotonic()


def run_supervisor(shared: SharedFleet, *, restarted: bool) -> None:
    """The supervisor process body: fresh settings, a fresh event loop, run until signalled."""
    import asyncio

    import uvloop

    from narwhal import metrics
    from narwhal.logs import configure_logging
    from narwhal.settings import load_settings_or_exit
    from narwhal.supervisor.main import Supervisor

    settings = load_settings_or_exit()
    configure_logging(settings.log)
    if restarted:
        metrics.SUPERVISOR_RESTARTS.inc()
    supervisor = Supervisor(shared, settings)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, done.set)
        runner = asyncio.ensure_future(supervisor.run())
        waiter = asyncio.ensure_future(done.wait())
        await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
        runner.cancel()
        waiter.cancel()
        if runner.done() and not runner.cancelled() and runner.exception() is not None:
            raise runner.exception()  # type: ignore[misc]

    uvloop.run(main())
