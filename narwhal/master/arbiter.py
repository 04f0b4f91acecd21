"""What Narwhal changes in gunicorn's Arbiter (the master), all of it here, and why.

gunicorn gives the master no periodic hook and no hook around a fork's signal mask, so four of
the Arbiter's methods are wrapped, on the running instance only (never its class), at
``on_starting``; each wrapper calls gunicorn's own method, and adds:

* ``manage_workers``: the supervisor keeper's check (``master.keeper``), which gunicorn's main
  loop then makes at least once a second and after every signal;
* ``reap_workers``: the same check while a SIGHUP reload waits for its old workers, the only
  call that wait makes;
* ``stop``: the keeper told to stop restarting first, so a master on its way out forks no
  supervisor again;
* ``spawn_worker``: the stop signals blocked across the fork, so a stop right after a fork is
  never lost (``worker.lifecycle`` takes them once the worker's loop runs);
* ``reload``: a SIGHUP whose settings file would be refused changes nothing at all (one line):
  gunicorn's own reload replaces every worker whatever the file holds, so a refused reload
  restarted the fleet's workers on the settings they already ran.

Everything else of gunicorn (signals, reloads, the worker count, timeouts) is its own. A gunicorn
release that renames one of these methods fails ``tests/unit/master/test_arbiter.py``, not a fleet.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from narwhal.stop_signals import STOP_SIGNALS

if TYPE_CHECKING:
    from gunicorn.arbiter import Arbiter

    from narwhal.master.keeper import SupervisorKeeper

WRAPPED = ("manage_workers", "reap_workers", "stop", "spawn_worker", "reload")


def adapt(server: Arbiter, keeper: SupervisorKeeper, reload_refusal: Callable[[], str | None]) -> None:
    """Wrap the four methods (the module's opening text) of the running master ``server``."""
    _watch_from_the_main_loop(server, keeper)
    _hold_stop_signals_across_fork(server)
    _refuse_before_replacing(server, reload_refusal)


def _refuse_before_replacing(server: Arbiter, reload_refusal: Callable[[], str | None]) -> None:
    """A reload whose settings would be refused (``reload_refusal``: why, or None) is refused
    before gunicorn replaces any worker."""
    reload = server.reload

    def reload_unless_refused() -> None:
        why = reload_refusal()
        if why is not None:
            print(f"narwhal: reload refused, keeping the running settings and workers: {why}", file=sys.stderr,
                  flush=True)
            return
        reload()

    server.reload = reload_unless_refused


def _watch_from_the_main_loop(server: Arbiter, keeper: SupervisorKeeper) -> None:
    """gunicorn has no periodic master hook; its main loop calls ``manage_workers`` at least
    once a second and after every signal (SIGCHLD included), and a reload's wait for the old
    workers calls ``reap_workers``: the keeper's check rides on both
    (see ``narwhal.supervisor.process``). ``stop``, the master's way out, ends the restarts."""
    manage_workers, reap_workers = server.manage_workers, server.reap_workers

    def manage_workers_and_supervisor() -> None:
        manage_workers()
        keeper.check()

    def reap_workers_and_supervisor() -> None:
        # A SIGHUP reload waits in Arbiter.reload, calling only reap_workers every 0.1 s, until
        # the old workers are gone (up to the graceful timeout, while they finish streams): the
        # supervisor it stopped must be replaced from there too, not once the wait is over
        # (the old workers' reports met no supervisor, or one that dropped them).
        reap_workers()
        keeper.check()

    server.manage_workers = manage_workers_and_supervisor
    server.reap_workers = reap_workers_and_supervisor
    stop = server.stop

    def stop_restarting_then_stop(graceful: bool = True) -> None:
        # Arbiter.stop is the master's way out (SIGTERM, SIGINT, SIGQUIT, a crash) and calls
        # reap_workers while the workers drain. A supervisor that signal also reached (systemd's
        # default KillMode=control-group signals every process of the unit) must not be forked
        # again from there, to log engine discovery after "Shutting down"; one the signal did not
        # reach keeps serving the draining workers until on_exit stops it.
        keeper.stopping = True
        stop(graceful)

    server.stop = stop_restarting_then_stop



def _hold_stop_signals_across_fork(server: Arbiter) -> None:
    """A worker is forked with the master's signal handlers and keeps them until aiohttp
    replaces them; its loop's handlers then only fire once the loop runs (uvloop learns of a
    signal through its self-pipe, opened when it starts running). A stop signal in between
    (a stop right after a fork: TTIN, a reload, a replaced worker) was lost, and the master,
    which signals once, waited out the whole graceful timeout before killing the worker.
    So the master forks with the stop signals blocked: it takes its own as soon as the fork
    returns, and the worker's stay pending until its loop runs (``worker.lifecycle``)."""
    spawn_worker, master = server.spawn_worker, os.getpid()

    def spawn_worker_holding_stop_signals() -> Any:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return spawn_worker()
        finally:
            if os.getpid() == master:  # the worker leaves spawn_worker by SystemExit, still blocked
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    server.spawn_worker = spawn_worker_holding_stop_signals
