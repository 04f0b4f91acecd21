"""The supervisor process's own body (``run_supervisor``), what the master's keeper forks
(``narwhal.master.keeper``): its title in ``ps``, the death signal that ends it with the master,
the master's settings, a fresh event loop running ``supervisor.loop`` until signalled."""

from __future__ import annotations

import ctypes
import signal

from narwhal.shm.shared import SharedFleet

PR_SET_PDEATHSIG = 1
TITLE = "narwhal: supervisor"


def set_parent_death_signal(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere the ``getppid`` check)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the getppid check still ends us
        pass


def set_title(title: str) -> None:
    """What ``ps`` and ``top`` show for this process (``setproctitle`` is a dependency)."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # pragma: no cover - installed with narwhal
        return
    setproctitle(title)


def run_supervisor(shared: SharedFleet, *, restarted: bool) -> None:
    """The supervisor process body: the master's settings, a fresh event loop, run until signalled."""
    import asyncio

    import uvloop

    from narwhal import metrics
    from narwhal.logs import configure_logging
    from narwhal.settings import current_or_load
    from narwhal.supervisor.edge import Supervisor
    from narwhal.supervisor.loop import run

    set_title(TITLE)
    # The settings the master validated and reconciled with gunicorn's options (the workers
    # run on the same object), not a fresh read that could disagree with them.
    settings = current_or_load()
    configure_logging(settings.log)
    if restarted:
        metrics.SUPERVISOR_RESTARTS.inc()
    from narwhal import shm

    supervisor = Supervisor(shared, settings, policy_region=shm.POLICY_REGION)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, done.set)
        runner = asyncio.ensure_future(run(supervisor))
        waiter = asyncio.ensure_future(done.wait())
        await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
        runner.cancel()
        waiter.cancel()
        if runner.done() and not runner.cancelled() and runner.exception() is not None:
            raise runner.exception()  # type: ignore[misc]

    uvloop.run(main())
