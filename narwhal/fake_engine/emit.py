"""How a completion's bytes leave the fake engine: SSE writes, error bodies, dropped connections.

Invariant: this module decides only how and when bytes go out (and how a connection dies). It
takes frames that ``chunks`` already encoded and knows nothing about requests, faults or KV, so
``generate.py`` sequences a request's events without caring how they are written. Two modes that
put the same body bytes on the wire:

* faithful (default): the headers go out at once, like Starlette, and each frame is its own
  write, so a router sees vLLM's timing;
* ``coalesce``: nothing is sent until there is something to wait for (a pause, a heartbeat, a
  dropped connection), so a stream without any wait becomes one plain response whose body holds
  every frame: one syscall instead of one per token, which keeps the fake from being the
  bottleneck of the perf suite.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Protocol

import orjson
from aiohttp import web

from narwhal.fake_engine.chunks import error_object

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def error_response(
    status: int, message: str, *, err_type: str | None = None, param: str | None = None, flat: bool = False
) -> web.Response:
    """A vLLM (OpenAI-shaped) error body with ``status``; ``flat``: the ≤0.9 form."""
    body = error_object(status, message, err_type=err_type, param=param, flat=flat)
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def drop_connection(request: web.BaseRequest, *, rst: bool) -> None:
    """Close the TCP connection under the handler: RST for ``reset``, FIN after a partial body."""
    transport = request.transport
    if transport is None:
        return
    if rst:
        sock = transport.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, AttributeError):
            pass
        transport.abort()
    else:
        transport.close()


class ResponseHolder(Protocol):
    """Where the emitter leaves the response once its headers are out (an abort returns it)."""

    resp: web.StreamResponse | None


class Emitter:
    """Writes frames one by one (faithful), or coalesced until the next pause (``coalesce``)."""

    __slots__ = ("request", "state", "resp", "buf", "coalesce")

    def __init__(self, request: web.Request, state: ResponseHolder, coalesce: bool) -> None:
        self.request = request
        self.state = state
        self.resp: web.StreamResponse | None = None
        self.buf: list[bytes] = []
        self.coalesce = coalesce

    async def start(self) -> None:
        """Faithful mode: send the 200 and headers now, as Starlette does; coalesced: nothing yet."""
        if not self.coalesce:
            await self._prepare()

    async def _prepare(self) -> web.StreamResponse:
        resp = self.resp
        if resp is None:
            resp = self.resp = self.state.resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await resp.prepare(self.request)
        return resp

    async def emit(self, frame: bytes) -> None:
        """Write ``frame`` now (faithful) or buffer it until the next pause (coalesced)."""
        if self.coalesce:
            self.buf.append(frame)
        else:
            await self.resp.write(frame)  # type: ignore[union-attr]  # prepared by start()

    async def flush(self) -> web.StreamResponse:
        """Send what is buffered; afterwards the headers are out in any mode."""
        resp = await self._prepare()
        if self.buf:
            data = b"".join(self.buf)
            self.buf.clear()
            await resp.write(data)
        return resp

    async def finish(self) -> web.StreamResponse:
        """End the answer: unsent, everything as one plain 200 body; started, flush what is buffered."""
        if self.resp is None:
            body = b"".join(self.buf)
            self.buf.clear()
            return web.Response(status=200, headers=SSE_HEADERS, body=body)
        return await self.flush()

    async def pause(self, seconds: float, heartbeat_s: float | None, heartbeat: bytes) -> None:
        """Sleep; every ``heartbeat_s`` send a metadata event (resets a router's silence timer)."""
        resp = await self.flush()
        if heartbeat_s is None:
            await asyncio.sleep(seconds)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (remaining := deadline - loop.time()) > 0:
            if remaining <= heartbeat_s:
                await asyncio.sleep(remaining)
                return
            await asyncio.sleep(heartbeat_s)
            await resp.write(heartbeat)
