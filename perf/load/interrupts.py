"""SIGTERM and Ctrl-C stop a perf run cleanly, wherever it is (``INTERRUPTS``, one per process).

A run leaves gunicorn masters, fake engines and a peer behind unless every exit passes through
``main.run``'s ``finally``; this module makes a signal take that path both inside the event loop
and outside it (see ``Interrupts``).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Interrupts:
    """SIGTERM and Ctrl-C stop the run cleanly, wherever it is.

    Raising from a signal handler while the event loop runs would land in whatever callback is
    running (uvloop reports it as a transport error and carries on), so inside the loop the
    handler only cancels the scenario's task, whose ``finally`` blocks stop its load; between
    scenarios (starting processes, sync code) it raises KeyboardInterrupt. Either way ``main.run``'s
    ``finally`` then stops every process.
    """

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.hit = False
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started in the background with SIGINT ignored: keep it so
            self._saved[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.hit = True
        if self.task is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    def run(self, runner: asyncio.Runner, coro: Coroutine[Any, Any, T]) -> T:
        async def guarded() -> T:
            self.task, self.loop = asyncio.current_task(), asyncio.get_running_loop()
            try:
                return await coro
            finally:
                self.task = self.loop = None

        try:
            return runner.run(guarded())
        except asyncio.CancelledError:
            if self.hit:
                raise KeyboardInterrupt("interrupted") from None
            raise


INTERRUPTS = Interrupts()
