"""A worker that stops right after accepting a connection still serves the request sent on it.

Why (found in ``test_worker_recycling_keeps_counts_and_shared_state_right``, 32 s once in a
full run): a worker retiring at gunicorn's ``max_requests`` stops its site at once. A connection
it had just accepted was still being made (``connect_accepted_socket`` is a task), so aiohttp's
stop did not yet know it and did not close it; its handler then waited for a request that
aiohttp's ``data_received`` drops once the server is shutting down, and the client waited out
the whole graceful timeout (28.5 s) for a disconnect. Real sockets, aiohttp's real runner."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from narwhal.worker.accept import BalancedSite

REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def _hello(request: web.Request) -> web.Response:
    return web.Response(text="served")


async def test_a_connection_accepted_as_the_site_stops_gets_its_answer() -> None:
    app = web.Application()
    app.router.add_get("/", _hello)
    runner = web.AppRunner(app, shutdown_timeout=30)
    await runner.setup()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    site = BalancedSite(runner, listener, None)
    await site.start()
    reader, writer = await asyncio.open_connection(*listener.getsockname())
    try:
        async with asyncio.timeout(5):
            while not site.connecting:  # accepted, its connection not made yet
                await asyncio.sleep(0)
        stop = asyncio.ensure_future(runner.cleanup())  # max_requests: the worker's loop ends
        await asyncio.sleep(0)  # the stop under way: the client sends its request
        writer.write(REQUEST)
        async with asyncio.timeout(5):  # not the 28.5 s of the graceful timeout
            answer = await reader.read()
            await stop
    finally:
        writer.close()
        listener.close()
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"served")
