"""One keep-alive upstream HTTP/1.1 connection and the response being read on it.

The half of ``engines.http1`` that runs per socket read: ``httptools`` feeds the protocol
callbacks below, and nothing else happens per chunk. Split from the pool (``http1.py``: origins,
request heads, reuse) along that seam, so the hot path reads in one place.

Invariants, and why they hold:

* every body byte is delivered exactly once and in order, either to the ``sink`` (one call per
  socket read, see ``data_received``) or to the buffer that ``read_some`` / ``take`` empty;
* no Python runs per HTTP chunk: httptools hands each chunk to ``on_body``, which is the body
  list's own C ``append`` (bound once, so the list is emptied in place, never replaced), and
  what the read brought is dealt with once, after the parser returns — the reader woken once,
  or the sink called once. An engine writes every SSE event as its own chunk: a Python
  ``on_body`` and its wakeup check would be five calls per event, an eighth of what a whole
  16-token request costs the worker; the head, the body and the end seen in one read wake the
  reader once, not once each;
* an exchange fails with its *first* error only (``_fail``), so a deadline that fires after a
  lost connection does not rename the failure;
* a connection goes back to the pool only when its response ended cleanly, was read whole and
  the server keeps it alive (``release``); anything else closes it, so no request is ever
  written behind the remains of another;
* buffering is bounded: above ``HIGH_WATER`` bytes unread the socket is paused until a reader
  takes them; headers over ``MAX_HEAD`` bytes fail the exchange.

What an exchange fails with is ``engines.http1_errors`` (the connection raises all but
``ConnectFailed``), re-exported by ``engines.http1``; ``engines.failures`` maps them to the
router's reasons.
"""

from __future__ import annotations

import asyncio
import math
import re
import select
from collections.abc import Callable
from typing import Protocol, cast

import httptools

from narwhal.engines.http1_errors import ConnectionLost, DeadlinePassed, ProtocolError, UpstreamError

HIGH_WATER = 256 * 1024
MAX_HEAD = 64 * 1024  # status line and headers: an engine sending more is broken, not verbose
_WRITE_JOINED_MAX = 64 * 1024  # above this, head and body go out with writev instead of a copy


# A header line giving the body a length: Content-Length, or a Transfer-Encoding that
# includes chunked. Otherwise the body ends with the connection.
_FRAMED = re.compile(rb"\n(?:content-length[ \t]*:|transfer-encoding[ \t]*:[^\n]*chunked)", re.IGNORECASE)


def _head_end(head: bytes) -> int:
    """Where the header block in ``head`` ends (the rest, if any, is body)."""
    end = head.find(b"\r\n\r\n")
    if end == -1:
        end = head.find(b"\n\n")  # a lenient server's bare LF
    return len(head) if end == -1 else end


class Pool(Protocol):
    """What a connection reports back to: the pool that made it (``engines.http1.UpstreamPool``).

    A protocol here, not an import of the pool: the pool makes connections and the connection
    only tells it two things, so the arrow points one way (the pool's module imports this one)."""

    def _put(self, conn: Connection) -> None:
        """A response ended cleanly on ``conn``: keep it for the next request to ``conn.key``."""

    def _forget(self, conn: Connection) -> None:
        """``conn`` closed: drop it, idle or not."""


class Connection(asyncio.Protocol):
    """One keep-alive connection and the response currently being read on it."""

    def __init__(self, pool: Pool, key: str) -> None:
        self._pool = pool
        self.key = key  # the origin's (``scheme://host:port``): where the pool keeps it when idle
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.sink: Callable[[bytes], None] | None = None
        # Every body byte not yet taken, in order. httptools calls ``on_body`` per chunk: bound
        # to this list's C ``append``, that is no Python frame at all (see the module's text).
        self._body: list[bytes] = []
        self.buffered = self._body  # the same list, public: "are body bytes here?" costs no call
        self.on_body = self._body.append
        self._parser = httptools.HttpResponseParser(self)  # after on_body: the parser binds it once
        self.idle_since = 0.0
        self._fd = -1  # the socket's, for dropped()
        self._closed = False
        self._news = False  # the parser saw the head or the end during this read: wake the reader
        self._hold_head = False  # a stream's reader waits past a 200 head for its first body bytes
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self._framed = False  # Content-Length or chunked; otherwise the body ends at EOF
        self._body.clear()
        self._buffered = 0  # bytes of reads that brought body since the last take (framing included)
        self._paused = False
        self._error: UpstreamError | DeadlinePassed | None = None
        self._head = b""  # the bytes read before the headers ended (usually one read)
        self._raw_head = b""  # the same, kept once the headers ended, for header() (off the hot path)

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """asyncio: the socket is up."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        """asyncio, per socket read: parse, then one sink call or one wakeup for what the read brought."""
        if not self.headers_done:
            self._head = self._head + data if self._head else data
        body = self._body
        last = body[-1] if body else None  # a new chunk is a new object: "did body come?" costs no call
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            sink = self.sink
            if sink is not None and body:  # what was parsed before the fault still goes out, in order
                data = body[0] if len(body) == 1 else b"".join(body)
                del body[:]
                sink(data)
            self._fail(ProtocolError(f"invalid HTTP response: {exc}"))
            self.close()
            return
        news = self._news
        if (body[-1] if body else None) is not last:  # this read brought body: one sink call, or one wakeup
            sink = self.sink
            if sink is not None:
                # One sink call per read (it runs once per token of a paced stream). The list holds
                # this read's chunks only (the relay took the rest when it started); each chunk
                # is its own object, so one chunk is first and last at once.
                first = body[0]
                data = first if first is body[-1] else b"".join(body)
                del body[:]  # clear() without a method call
                sink(data)
            else:
                self._buffered += len(data)
                if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
                    self._paused = True
                    self.transport.pause_reading()
                news = True
        if news:  # one wakeup per read, whatever the read brought (head, body, end)
            self._news = False
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        if not self.headers_done:
            if len(self._head) > MAX_HEAD:  # the parser would buffer headers without end
                self._fail(ProtocolError(f"response headers over {MAX_HEAD} bytes"))
                self.close()

    def eof_received(self) -> bool | None:
        """asyncio: close the transport; :meth:`connection_lost` says what the EOF meant."""
        return None  # close the transport; connection_lost decides what the EOF meant

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio: a body framed by EOF is complete, any other unfinished response fails."""
        self._closed = True
        self._pool._forget(self)
        if not self.complete:
            if self.headers_done and not self._framed and self._error is None:
                self.complete = True  # a body delimited by the end of the connection
            else:
                self._fail(ConnectionLost("the connection closed before the response ended",
                                          got_headers=self.headers_done))
        self._wake()

    # -- httptools callbacks --------------------------------------------------------------

    # No on_header: a Python call per header line was most of the callbacks per response;
    # the one fact the headers give here (is the body framed?) is read from the head at once.

    def on_headers_complete(self) -> None:
        """httptools: the status and head are in; the reader is woken after the read."""
        self.status = self._parser.get_status_code()
        head = self._head
        end = _head_end(head)
        self._framed = _FRAMED.search(head, 0, end) is not None
        self._raw_head, self._head = self._head, b""  # a reference kept, not a copy
        self.headers_done = True
        # data_received wakes the reader once the read is parsed; a stream's reader that waits
        # for its first body bytes too (response(first_body=True)) is not woken by a 200 head alone.
        self._news = not self._hold_head or self.status != 200

    # on_body: the body list's append, set in __init__.

    def on_message_complete(self) -> None:
        """httptools: the response ended; a server that will not keep alive makes it unreusable."""
        self.complete = True
        if not self._parser.should_keep_alive():
            self._closed = True  # not reusable; closed when released
        self._news = True

    # -- the reader's side ----------------------------------------------------------------

    def _fail(self, error: UpstreamError | DeadlinePassed) -> None:
        if self._error is None:
            self._error = error

    def arm(self, deadline: float | None) -> None:
        """Fail this exchange with :class:`DeadlinePassed` at ``deadline`` (loop time).

        One timer handle per exchange, cheaper than an ``asyncio.timeout`` block around every
        wait (the perf suite saw those as several percent of a worker's CPU)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is not None and deadline != math.inf:
            self._timer = self._loop.call_at(deadline, self._expire)

    def disarm(self) -> None:
        """Cancel the exchange's deadline (:meth:`arm`); the caller bounds each read itself."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        self._fail(DeadlinePassed())
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        """Wait for the next event: headers, the end, a failure, or a ``wake()``."""
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def response(self, first_body: bool = False) -> int:
        """Wait for the status line and headers; return the status. With ``first_body``, after a
        200 wait for the first body bytes too (or the end, or a failure): one wakeup where the
        head then a body read took two, since an engine sends a stream's head at once and its
        first event only with the first token. A 200 that fails before any body raises its error
        here, with ``headers_done`` set."""
        self._hold_head = first_body
        try:
            while not self.headers_done or (
                first_body and self.status == 200 and not (self._body or self.complete)
            ):
                if self._error is not None:
                    raise self._error
                await self._wait()
        finally:
            self._hold_head = False
        return self.status

    def header(self, name: str) -> str | None:
        """The value of the response header ``name`` (its first line), once the headers ended.

        Parsed on demand from the head kept at ``on_headers_complete``: the legs that relay
        bytes never ask, so no header is parsed per response on their path."""
        head = self._raw_head
        found = re.search(rb"\n" + re.escape(name.encode("latin-1")) + rb"[ \t]*:[ \t]*([^\r\n]*)",
                          head, re.IGNORECASE)
        if found is None or found.start() > _head_end(head):
            return None
        return found.group(1).strip().decode("latin-1")

    @property
    def failed(self) -> bool:
        """Has this exchange failed (its first error kept)?"""
        return self._error is not None

    def wake(self) -> None:
        """Wake whoever waits in :meth:`wait` (a relay that needs its reader)."""
        self._wake()

    wait = _wait  # the relay's wait, one frame (not a coroutine around _wait) per wakeup

    def take(self) -> list[bytes]:
        """Every body chunk buffered now, as received (for a relay taking over the body)."""
        chunks = self._body[:]
        self._body.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunks

    def read_now(self) -> bytes:
        """Every body byte buffered now, when :attr:`buffered` is not empty (no wait, no timer)."""
        chunks = self._body
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_some(self) -> bytes:
        """Every body byte buffered now (waiting for some first); ``b""`` once the body ended."""
        chunks = self._body
        while not chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait()
        return self.read_now()

    async def read_all(self) -> bytes:
        """The rest of the body, whole."""
        if self.complete and self._error is None:  # the usual case: all of it is here already
            return self.read_now() if self._body else b""
        parts: list[bytes] = []
        while True:
            data = await self.read_some()
            if not data:
                return b"".join(parts) if len(parts) != 1 else parts[0]
            parts.append(data)

    async def read_to_end(self, seconds: float) -> bool:
        """Read what is left of the body within ``seconds``; False when it did not end cleanly
        then (a draining read, not a leg: the connection is then closed, never pooled)."""
        try:
            async with asyncio.timeout(seconds):
                await self.read_all()
        except (TimeoutError, UpstreamError):
            return False
        return True

    def release(self) -> None:
        """Done with this response: back to the pool if it ended cleanly, else closed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.complete and self._error is None and not self._closed and not self._body:
            self._reset()
            self._pool._put(self)
        else:
            self.close()

    def close(self) -> None:
        """Close for good: the deadline cancelled, never pooled again."""
        self.disarm()
        self._closed = True
        if self.transport is not None:
            self.transport.close()

    @property
    def reusable(self) -> bool:
        """Open and not closing: a pooled connection still fit for the next request."""
        return not self._closed and self.transport is not None and not self.transport.is_closing()

    def dropped(self) -> bool:
        """Whether the engine ended this idle connection and the loop has not read it yet.

        An idle HTTP/1.1 connection has nothing to read, so a socket with something to read is
        its end: EOF or a reset. Why ask before reuse (urllib3 does the same): an engine that
        stops or restarts resets its connections, and the loop may run the next request before
        it reads the reset. That request would go out on a dead connection and fail as "closed
        the connection before a response", where a fresh connection says the truth: refused
        (unreachable, docs/behaviour.md "Recovery"), or accepted by the engine's new process. One ``poll`` per reuse."""
        if self._fd < 0:
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    def send(self, head: bytes, body: bytes, size: int | None = None) -> None:
        """Write a request: ``size`` is ``len(body)`` when the caller has it already."""
        transport = self.transport
        assert transport is not None
        if (len(body) if size is None else size) <= _WRITE_JOINED_MAX:
            transport.write(head + body)
        else:
            transport.writelines((head, body))

