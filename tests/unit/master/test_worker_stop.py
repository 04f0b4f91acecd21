"""A worker's SIGTERM (``worker.lifecycle.post_worker_init``'s handler) wakes aiohttp's worker
loop itself, ``ACCEPTED_GRACE_S`` after the signal: gunicorn's ``handle_exit`` only clears
``alive``, which aiohttp's loop otherwise looks at on its own check once a second, so every stop
began anywhere from 0 to 1 s late (every router stop in the suite paid ~1 s of it)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest
from aiohttp.worker import GunicornWebWorker
from gunicorn.config import Config

from narwhal.worker import app, lifecycle


async def test_a_sigterm_wakes_the_worker_loop_after_the_accepted_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app, "_stop_requested_at", None)  # the handler notes the stop here
    loop = asyncio.get_running_loop()
    worker = GunicornWebWorker(0, os.getppid(), [], None, 30, Config(), logging.getLogger("test"))
    worker.loop, worker.wsgi = loop, None
    # What the worker's run loop awaits between its checks, here without the 1 s timer that
    # would also end it: only the SIGTERM handler's wake can.
    worker._notify_waiter = waiter = loop.create_future()
    lifecycle.post_worker_init(worker)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(waiter, timeout=10)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        worker.tmp.close()
    assert worker.alive is False
    assert app._stop_requested_at is not None
