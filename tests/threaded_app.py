"""An aiohttp application served on 127.0.0.1 from a thread of its own: a test's engine that is
not the fake (one answering garbage, one sending an event that never ends), beside a router under
real gunicorn. A subclass builds its application in :meth:`ThreadedApp.build`."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ThreadedApp:
    """Serves :meth:`build`'s application until :meth:`stop`; ``url`` is where."""

    def __init__(self) -> None:
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), f"{type(self).__name__} did not start"

    def build(self) -> web.Application:
        """The application to serve (in the server's thread, on its loop)."""
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self.build(), access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        """Close the server (its handlers finished or cancelled) and end the thread."""
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
