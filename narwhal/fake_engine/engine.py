"""One fake vLLM engine that listens: the state of ``state.py`` plus its HTTP app and listener.

Invariant: this is the top of the engine's import stack. ``FakeEngine`` adds only what needs the
assembled app (start, stop and restart on the same port, the app's lifecycle) to the shared
``EngineState``, and ``build_engine_app`` wires the routes; the modules below (``state``, ``kv``,
``generate``, ``routes``) never import this one, so the package has no import cycle.

Why a separate app builder: tests want the app in-process (``aiohttp_client`` on
``build_engine_app(engine)``), while the fleet process wants each engine to own a real
``AppRunner``/``TCPSite`` that it can stop and restart on the same port (the control server's
"refuse connections" fault). Both share the same engine state, so stats, records, held blocks and
faults look the same either way.

The runner uses ``handler_cancellation=True`` on purpose: aiohttp's TestServer forces it on, and a
router that closes a decode stream must really abort the engine's request (the ``aborted_streams``
counter proves it), in tests and in the fleet alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from narwhal.fake_engine import kv, routes, state
from narwhal.fake_engine.state import EngineState

SWEEP_INTERVAL_S = 0.25

UVICORN_BACKLOG = 2048  # uvicorn.Config(backlog=2048): what a vLLM engine listens with


class FakeEngine(EngineState):
    """A fake engine that serves HTTP: ``EngineState``'s constructor, plus its own listener."""

    _runner: web.AppRunner | None = None
    _site: web.TCPSite | None = None

    async def pull_kv(self, params: dict[str, Any]) -> bool:
        """Read a producer's KV as a decode would (``kv.consumer_pull``, counted here)."""
        return await kv.consumer_pull(self, params)

    # -- lifecycle -------------------------------------------------------------------------------

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        state.register(self)
        self.serving = True
        sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        try:
            yield
        finally:
            self.serving = False
            sweeper.cancel()
            await self.end_background(sweeper)
            state.unregister(self)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.kv.sweep()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0 = ephemeral); again on the same port after ``stop()``."""
        if self._runner is None:
            self._runner = web.AppRunner(
                build_engine_app(self), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
            )
            await self._runner.setup()
        if self._site is None:
            self.listen_host = host
            # vLLM serves through uvicorn, whose listen backlog is 2048; aiohttp's default of 128
            # overflowed when a thousand streams connected at once (perf paced_c1000: resets
            # that a real engine would not have sent, seen by the router and the PD floor alike).
            site = web.TCPSite(
                self._runner, host, self.port if self.port and not port else port, ssl_context=self.ssl_context,
                backlog=UVICORN_BACKLOG,
            )
            await site.start()
            self._site = site
            self.port = site.port
        self.serving = True
        self.start_kv_events()
        assert self.url is not None
        return self.url

    async def stop(self) -> None:
        """Refuse connections: close the listening socket and abort every open connection."""
        self.serving = False
        if self._site is not None:
            await self._site.stop()
            self._site = None
        server = self._runner.server if self._runner is not None else None
        if server is not None:
            for handler in server.connections:
                transport = handler.transport
                if transport is not None:
                    transport.abort()

    async def close(self) -> None:
        """Stop, free the app runner and leave the registry, so no KV pull finds this engine."""
        await self.stop()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
            self.kv_publisher = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        state.unregister(self)


ENGINE_KEY = web.AppKey("narwhal_fake_engine", FakeEngine)


def build_engine_app(engine: FakeEngine) -> web.Application:
    """The engine's aiohttp app: vLLM's OpenAI routes plus the fake's own ``/fake/*`` routes."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app.cleanup_ctx.append(engine._lifecycle)
    routes.add_routes(app, engine)
    return app
