"""The client's side of one response: what was committed, and writing it without waiting long.

A :class:`ClientStream` owns the response a request answers with, its flow control and the
``committed`` flag that every decision after the first token reads (retry or not, HTTP error
or terminal event, whose fault a failure was, whether a handoff still needs releasing). The
access-log record only *records* what happened; nothing decides from it.

HTTP 200 and the headers go out only with the first generated token (docs/behaviour.md "Decode"); after
that, spans relayed from the engine's data callback go straight to the client's transport
through the :class:`ClientSink`, framed as aiohttp frames the rest of the body. A client that
does not read for ``server.client_write_timeout_s`` is dropped: its buffer stops growing and
the engine stream is closed, as for any departed client; and the clients that are behind may
hold only so much of the worker's memory together (``request.stream_buffers``). Writes that cannot wait (small, into
an empty buffer: the usual case, the first token's included) arm no timer at all; the write
timer itself is made only when a write first has to wait, and the sink reads the response's
framing only when it first relays a span (most unpaced streams end in their first span), and
the terminal span ends the body itself, with no empty end written after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from aiohttp import web
from multidict import CIMultiDict

from narwhal.engines.dialects import DEFAULT_ERRORS, Dialect
from narwhal.engines.timers import LazyTimeout
from narwhal.errors import NarwhalError
from narwhal.request import stream_buffers
from narwhal.request.stream_buffers import StreamBuffers

if TYPE_CHECKING:
    from narwhal.request.migration.transcript import Transcript

# Copied per stream: cheaper than building the header set from a dict each time.
SSE_HEADERS = CIMultiDict({"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
# A write of at most this many bytes into an empty transport buffer can not pause it (the
# high-water mark is 64 KiB, never lowered here), so aiohttp's write returns without waiting.
_UNBLOCKED_WRITE = 16 * 1024


class _SSEResponse(web.StreamResponse):
    # Headers go out in the same write as the first token (one syscall, one client wakeup)
    # instead of on their own: prepare() is only called once that token is in hand anyway.
    _send_headers_immediately = False


class ClientSink:
    """Writes relayed spans (``narwhal.engines.relay``) straight to the client's transport,
    framed as aiohttp frames the rest of the response (chunked on HTTP/1.1). Used only after
    the first token went out through aiohttp, so headers and ordering are already settled.
    A stream that may migrate has its ``transcript`` keep each span written: here, where the
    span goes out, rather than in a sink of its own in front (one call per span, not two)."""

    __slots__ = ("_transport", "_chunked", "_high", "stream", "transcript")

    def __init__(self, request: web.Request) -> None:
        self._transport = request.transport
        self._chunked = True
        self._high = -1  # not read yet: most streams end in their first span and never relay
        self.stream: web.StreamResponse | None = None  # set once the stream is committed
        self.transcript: Transcript | None = None  # what the client was sent, for a migration

    def _settle(self) -> None:
        assert self.stream is not None
        self._chunked = self.stream.headers.get("Transfer-Encoding", "").lower() == "chunked"
        self._high = 0 if self._transport is None else self._transport.get_write_buffer_limits()[1]

    def __call__(self, span: bytes) -> bool:
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        if self._high < 0:
            self._settle()
        try:
            transport.write(b"%x\r\n%b\r\n" % (len(span), span) if self._chunked else span)
        except (OSError, RuntimeError):  # raised inside the engine's data callback: never let it out
            return False
        if self.transcript is not None:
            self.transcript.keep(span)
        return transport.get_write_buffer_size() <= self._high


class ClientStream:
    """The client's side of one request: committed once (a 200 or a whole answer), every write bounded."""

    __slots__ = (
        "request", "request_id", "response", "committed", "sink", "stream", "_writes", "_write_timeout_s", "dialect",
        "_direct", "_buffers",
    )

    def __init__(
        self, request: web.Request, request_id: str, write_timeout_s: float, dialect: Dialect | None = None,
        buffers: StreamBuffers | None = None,
    ) -> None:
        self.request = request
        self.dialect = dialect  # shapes the router's own errors for this endpoint's clients
        self.request_id = request_id
        self.response: web.StreamResponse | None = None
        self.committed = False  # a 200 (or a whole answer) is on its way: no HTTP error any more
        self.sink: ClientSink | None = None
        self.stream: web.StreamResponse | None = None  # the committed SSE response (not a whole answer)
        self._writes: LazyTimeout | None = None
        self._write_timeout_s = write_timeout_s
        self._direct = False  # the stream's head and first span went out: later spans may take the sink
        self._buffers = buffers  # the worker's budget for clients that are behind (request.stream_buffers)

    def relay_sink(self) -> ClientSink:
        """The sink a streamed decode hands its spans to once the stream is committed."""
        if self.sink is None:
            self.sink = ClientSink(self.request)
        return self.sink

    # -- committing -------------------------------------------------------------------------

    async def commit_stream(self) -> None:
        """The 200 and SSE headers, sent with the first token's write."""
        stream = _SSEResponse(headers=SSE_HEADERS)
        stream.headers["x-request-id"] = self.request_id
        self.response = self.stream = stream
        self.committed = True
        await stream.prepare(self.request)
        (self.sink or self.relay_sink()).stream = stream  # what the sink frames its spans by

    async def send_whole(self, body: bytes) -> web.Response:
        """A non-streaming answer, written here rather than by aiohttp after the handler returns,
        so the client has it before the bookkeeping; under the same write bound as a stream."""
        response = web.Response(body=body, content_type="application/json", headers={"x-request-id": self.request_id})
        self.response, self.committed = response, True
        if self._cannot_wait(len(body)):
            await _prepare_and_end(response, self.request)
            return response
        writes = LazyTimeout()
        try:
            await self._bounded(writes, _prepare_and_end(response, self.request))
        finally:
            writes.close()
        return response

    # -- writing a committed stream ---------------------------------------------------------

    async def write(self, data: bytes, *, eof: bool = False) -> None:
        """Write to the committed response (``eof``: and end it); a client not reading in time is cut off.

        Once the head and the first span went out through aiohttp, a span that does not end the
        body goes through the relay's sink, framed alike (a dozen calls of aiohttp's writer
        less), and only a client left behind waits, under the same bound as :meth:`drain`."""
        if self._direct and not eof and self.sink is not None:
            if not self.sink(data):
                await self.drain()
            return
        stream = self.response
        assert stream is not None
        if self.sink is not None and self.sink.transcript is not None:
            self.sink.transcript.keep(data)
        if self._cannot_wait(len(data)):
            await (stream.write_eof(data) if eof else stream.write(data))
        else:
            await self._bounded(self._write_timer(), stream.write_eof(data) if eof else stream.write(data))
        self._direct = self.stream is not None

    def _write_timer(self) -> LazyTimeout:
        # Made when a write first has to wait: most streams never do.
        if self._writes is None:
            self._writes = LazyTimeout()
        return self._writes

    async def drain(self) -> None:
        """The relay found the client behind: wait (bounded) until it reads."""
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        await self._bounded(self._write_timer(), self.request.writer.drain())

    async def fail(self, exc: NarwhalError) -> None:
        """After the 200: end the stream with one terminal error event (no [DONE] after it)."""
        assert self.stream is not None
        await self.stream.write((self.dialect or DEFAULT_ERRORS).error_event(exc))
        await self.stream.write_eof()

    def close(self) -> None:
        """Drop the write timer: once per request, in the router's ``finally``; idempotent."""
        if self._writes is not None:
            self._writes.close()
            self._writes = None

    # -- bounds -----------------------------------------------------------------------------

    def _cannot_wait(self, size: int) -> bool:
        """Would writing ``size`` bytes to this client return at once? Then no write timer is armed."""
        transport = self.request.transport
        return transport is not None and size <= _UNBLOCKED_WRITE and not transport.get_write_buffer_size()

    async def _bounded(self, writes: LazyTimeout, client_io: Awaitable[None]) -> None:
        """Wait for the client to take ``client_io``, within the write bound and the worker's
        stream buffers (``request.stream_buffers``): a client too slow for either is cut."""
        transport = self.request.transport
        charge = 0
        if self._buffers is not None:
            try:
                charge = self._buffers.charge(transport.get_write_buffer_size() if transport is not None else 0)
            except stream_buffers.BuffersFull:
                if hasattr(client_io, "close"):
                    client_io.close()  # never awaited: nothing of it runs
                if transport is not None:
                    transport.abort()
                raise
        bound = asyncio.get_running_loop().time() + self._write_timeout_s
        try:
            await writes.wait(client_io, bound)
        except TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()
            stream_buffers.cut("write_timeout")
            raise ConnectionResetError("the client stopped reading its stream") from None
        finally:
            if self._buffers is not None:
                self._buffers.release(charge)


async def _prepare_and_end(response: web.Response, request: web.Request) -> None:
    await response.prepare(request)
    await response.write_eof()
