"""What each gunicorn worker does as it starts and as it is told to stop.

Why here and not with the master's hooks: gunicorn calls ``post_worker_init`` in the worker
process, after the fork; the code it runs sets up the worker's accept loop
(``narwhal.worker.accept``) and its stop signal, and notes the stop in ``narwhal.worker.app``.
It is the worker's code, so it lives with the worker; ``narwhal.master.gunicorn_hooks`` only
hands it to gunicorn.

Invariants, and why:

* A worker is forked with the stop signals blocked (``master.arbiter``'s
  ``_hold_stop_signals_across_fork``): one sent while it boots stays pending, and is taken once
  its loop runs, so a worker stopped right after its fork stops as soon as it is up instead of
  being killed at the end of the graceful timeout.
* A SIGTERM wakes aiohttp's worker loop itself, ``accept.ACCEPTED_GRACE_S`` after the signal:
  gunicorn's ``handle_exit`` only clears ``alive``, which aiohttp looks at once a second.
* Nothing here imports ``prometheus_client`` (or ``narwhal.metrics``, ``narwhal.worker.app``)
  at module level: the master imports this module before ``PROMETHEUS_MULTIPROC_DIR`` is set.
"""

from __future__ import annotations

import signal
from typing import Any

from narwhal.stop_signals import STOP_SIGNALS


def post_worker_init(worker: Any) -> None:
    """In each worker: take over the listening sockets (``narwhal.worker.accept``), and note when
    SIGTERM arrives, so in-flight streams are ended before the master's graceful timeout
    (counted from the signal) rather than aiohttp's (counted from when the worker gets round
    to stopping, up to a second later)."""
    loop = getattr(worker, "loop", None)
    if loop is None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a worker of another class: its handlers are set
        return
    from narwhal.worker import accept, app

    if worker.wsgi is app.create_app and not worker.cfg.is_ssl:
        # Narwhal's app accepts from these itself (narwhal.worker.accept): aiohttp's worker starts
        # no server of its own on them. TLS listeners, and any other app run with this
        # configuration, stay with aiohttp.
        accept.LISTENERS[:] = worker.sockets
        worker.sockets = []

    def on_term() -> None:
        app.note_stop_requested(loop.time())
        worker.handle_exit(signal.SIGTERM, None)
        # gunicorn's handle_exit only clears ``alive``, which aiohttp's worker looks at once a
        # second (its notify waiter): the stop began anywhere from 0 to 1 s after the signal.
        # Woken ACCEPTED_GRACE_S after it instead: the listener is already closed, so that is
        # the time a connection accepted just before has to send its request before aiohttp
        # closes the idle ones (no longer sometimes none), and no stop waits the rest of the second.
        loop.call_later(accept.ACCEPTED_GRACE_S, _wake, worker)

    loop.add_signal_handler(signal.SIGTERM, on_term)
    # The stop signals the master blocked across the fork (master.arbiter): taken
    # once the loop runs, so one sent while the worker booted reaches on_term (or aiohttp's
    # handlers) and the worker stops as soon as it is up, instead of serving on.
    loop.call_soon(signal.pthread_sigmask, signal.SIG_UNBLOCK, STOP_SIGNALS)


def _wake(worker: Any) -> None:
    """Wake aiohttp's worker loop to see ``alive`` cleared (its waiter, a private of
    ``aiohttp.worker``; without it, the loop's own 1 s check still does)."""
    wake = getattr(worker, "_notify_waiter_done", None)
    if callable(wake):
        wake()
