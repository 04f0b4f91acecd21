"""A lean, pooled HTTP/1.1 client for the engine legs (prefill, decode, release).

Why not aiohttp's client here: every request through ``ClientSession`` builds a URL object, a
header multidict, a ``ClientRequest`` and a ``ClientResponse``, goes through the connector's
bookkeeping and trace hooks, and each body chunk then wakes a ``StreamReader`` whose reads are
coroutines of their own. The perf suite (``python -m perf``, ``--profile``) showed that as the
largest share of a worker's CPU per streamed request. Engines speak one narrow dialect —
``POST`` of a JSON body, an answer with ``Content-Length`` or chunked, keep-alive — so this
module does just that, in a few steps per request:

* the request head is prebuilt per engine and endpoint; per request only the request id, the
  forwarded headers and ``Content-Length`` are appended, and head and body go out in one write;
* responses are parsed by ``httptools`` (llhttp, the C parser aiohttp and Node.js also use)
  in protocol callbacks: body bytes are appended to a list and the waiting reader, if any, is
  woken once — a reader that falls behind gets everything buffered in one piece;
* connections are kept per origin, most recently used first, with no global cap (long SSE
  streams would exhaust one). An idle connection is reused for at most ``IDLE_S`` seconds, which
  is below the keep-alive of the servers engines run in (uvicorn, vLLM's server: 5 s), so a
  request is never written to a connection the engine is closing; a POST is never resent.
* a reader that does not keep up pauses the socket (``HIGH_WATER`` bytes buffered), so a slow
  client never makes the router buffer an engine's whole answer.

TCP_NODELAY is set by the event loop itself (uvloop and asyncio do it for every TCP transport);
``tests/unit/engines/test_http1.py`` checks it on the upstream sockets rather than setting it twice.

Errors are three classes, mapped to SPEC reasons in exactly one place (``engines.client``):
:class:`ConnectFailed` (nothing was sent), :class:`ConnectionLost` (the connection ended before
the whole response), :class:`ProtocolError` (bytes that are not HTTP/1.1).
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl
import time
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_S = 4.0
HIGH_WATER = 256 * 1024
MAX_HEAD = 64 * 1024  # status line and headers: an engine sending more is broken, not verbose
_WRITE_JOINED_MAX = 64 * 1024  # above this, head and body go out with writev instead of a copy


class UpstreamError(Exception):
    """A transport failure talking to an engine."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing was sent."""


class ConnectionLost(UpstreamError):
    """The connection ended before the whole response arrived."""

    def __init__(self, message: str, *, got_headers: bool) -> None:
        super().__init__(message)
        self.got_headers = got_headers


class ProtocolError(UpstreamError):
    """The engine sent bytes that are not a valid HTTP/1.1 response."""


class DeadlinePassed(TimeoutError):
    """The exchange's deadline (``post(..., deadline=)``) passed: the connection was closed."""


class Origin:
    """Where an engine URL points, with the request head prefix prebuilt per path."""

    __slots__ = ("scheme", "host", "port", "base_path", "ssl", "key", "_host_header", "_heads")

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.scheme = parts.scheme
        self.host = parts.hostname
        default = 443 if parts.scheme == "https" else 80
        self.port = parts.port or default
        self.base_path = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            # No default context here: one built on the spot would trust the system store, not
            # engine.ca_file. The context comes from engines.control, as on every engine link.
            if ssl_context is None:
                raise ValueError("an https:// engine needs a TLS context (engines.control.ssl_context)")
            self.ssl = ssl_context
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.key = f"{self.scheme}://{host}:{self.port}"
        self._host_header = host if self.port == default else f"{host}:{self.port}"
        self._heads: dict[tuple[str, str], bytes] = {}

    def head(self, method: str, path: str) -> bytes:
        """The request line and the fixed headers, ending in CRLF (more headers follow)."""
        key = (method, path)
        head = self._heads.get(key)
        if head is None:
            head = (
                f"{method} {self.base_path}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                "Accept: */*\r\nUser-Agent: narwhal\r\n"
            ).encode("latin-1")
            self._heads[key] = head
        return head


def header_lines(headers: Mapping[str, str]) -> bytes:
    """``Name: value`` lines for extra headers; a value with CR or LF is refused (injection)."""
    out = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"header {name!r} has a forbidden character")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


# A header line giving the body a length: Content-Length, or a Transfer-Encoding that
# includes chunked. Otherwise the body ends with the connection.
_FRAMED = re.compile(rb"\n(?:content-length[ \t]*:|transfer-encoding[ \t]*:[^\n]*chunked)", re.IGNORECASE)


def _head_end(head: bytes) -> int:
    """Where the header block in ``head`` ends (the rest, if any, is body)."""
    end = head.find(b"\r\n\r\n")
    if end == -1:
        end = head.find(b"\n\n")  # a lenient server's bare LF
    return len(head) if end == -1 else end


class Connection(asyncio.Protocol):
    """One keep-alive connection and the response currently being read on it."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.sink: Callable[[bytes], None] | None = None
        self._relayed: list[bytes] = []  # body bytes of the current read, for the sink
        self.idle_since = 0.0
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self._framed = False  # Content-Length or chunked; otherwise the body ends at EOF
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: UpstreamError | DeadlinePassed | None = None
        self._head = b""  # the bytes read before the headers ended (usually one read)

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if not self.headers_done:
            self._head = self._head + data if self._head else data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._relay()
            self._fail(ProtocolError(f"invalid HTTP response: {exc}"))
            self.close()
            return
        if self._relayed:
            self._relay()
        if not self.headers_done:
            if len(self._head) > MAX_HEAD:  # the parser would buffer headers without end
                self._fail(ProtocolError(f"response headers over {MAX_HEAD} bytes"))
                self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost decides what the EOF meant

    def connection_lost(self, exc: Exception | None) -> None:
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
        self.status = self._parser.get_status_code()
        self._framed = _FRAMED.search(self._head, 0, _head_end(self._head)) is not None
        self._head = b""
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            # A relay takes the bytes of this read, once it is parsed (see _relay).
            self._relayed.append(body)
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _relay(self) -> None:
        # One sink call per socket read, not per HTTP chunk: an engine writes every SSE event
        # as its own chunk, and a read that holds many of them becomes one client write.
        relayed = self._relayed
        if not relayed:
            return
        data = relayed[0] if len(relayed) == 1 else b"".join(relayed)
        relayed.clear()
        if self.sink is not None:
            self.sink(data)
        else:  # never lose bytes, even to a sink withdrawn mid-read
            self._chunks.append(data)
            self._buffered += len(data)

    def on_message_complete(self) -> None:
        self.complete = True
        if not self._parser.should_keep_alive():
            self._closed = True  # not reusable; closed when released
        self._wake()

    # -- the reader's side ----------------------------------------------------------------

    def _fail(self, error: UpstreamError | DeadlinePassed) -> None:
        if self._error is None:
            self._error = error

    def arm(self, deadline: float | None) -> None:
        """Fail this exchange with :class:`DeadlinePassed` at ``deadline`` (loop time).

        One timer handle per exchange, cheaper than an ``asyncio.timeout`` block around every
        wait (the perf suite saw those as several percent of a worker's CPU)."""
        self.disarm()
        if deadline is not None and deadline != math.inf:
            self._timer = self._loop.call_at(deadline, self._expire)

    def disarm(self) -> None:
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
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def response(self) -> int:
        """Wait for the status line and headers; return the status."""
        while not self.headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self.status

    @property
    def failed(self) -> bool:
        return self._error is not None

    def wake(self) -> None:
        """Wake whoever waits in :meth:`wait` (a relay that needs its reader)."""
        self._wake()

    async def wait(self) -> None:
        """Wait for the next event: headers, the end, a failure, or a ``wake()``."""
        await self._wait()

    def take(self) -> list[bytes]:
        """Every body chunk buffered now, as received (for a relay taking over the body)."""
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunks

    async def read_some(self) -> bytes:
        """Every body byte buffered now (waiting for some first); ``b""`` once the body ended."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_all(self) -> bytes:
        """The rest of the body, whole."""
        parts: list[bytes] = []
        while True:
            data = await self.read_some()
            if not data:
                return b"".join(parts) if len(parts) != 1 else parts[0]
            parts.append(data)

    def release(self) -> None:
        """Done with this response: back to the pool if it ended cleanly, else closed."""
        self.disarm()
        if self.complete and self._error is None and not self._closed and not self._chunks:
            self._reset()
            self._pool._put(self)
        else:
            self.close()

    def close(self) -> None:
        self.disarm()
        self._closed = True
        if self.transport is not None:
            self.transport.close()

    @property
    def reusable(self) -> bool:
        return not self._closed and self.transport is not None and not self.transport.is_closing()

    def send(self, head: bytes, body: bytes) -> None:
        transport = self.transport
        assert transport is not None
        if len(body) <= _WRITE_JOINED_MAX:
            transport.write(head + body)
        else:
            transport.writelines((head, body))


class UpstreamPool:
    """Keep-alive connections per engine origin; ``post`` sends a request and returns its
    :class:`Connection`, whose ``response()`` / ``read_some()`` / ``read_all()`` read the answer.
    The caller must end every exchange with ``release()`` (clean end) or ``close()``."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None, *, idle_s: float = IDLE_S) -> None:
        self._ssl = ssl_context
        self._idle_s = idle_s
        self._origins: dict[str, Origin] = {}
        self._idle: dict[str, list[Connection]] = {}
        self._open: set[Connection] = set()

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin(url, self._ssl)
        return origin

    async def post(
        self, url: str, path: str, headers: bytes, body: bytes, *, deadline: float | None = None
    ) -> Connection:
        """Send ``POST path`` with the JSON ``body``; ``headers`` are prebuilt header lines.

        With ``deadline`` (loop time), connecting and every wait on the answer raise
        ``TimeoutError`` once it passes (the connection is then closed); ``disarm()`` ends it.
        """
        origin = self.origin(url)
        conn = await self._acquire(origin, deadline)
        conn.arm(deadline)
        head = b"".join((
            origin.head("POST", path),
            headers,
            b"Content-Type: application/json\r\nContent-Length: ",
            str(len(body)).encode(),
            b"\r\n\r\n",
        ))
        conn.send(head, body)
        return conn

    async def _acquire(self, origin: Origin, deadline: float | None) -> Connection:
        idle = self._idle.get(origin.key)
        if idle:
            cutoff = time.monotonic() - self._idle_s
            while idle:
                conn = idle.pop()
                if conn.reusable and conn.idle_since > cutoff:
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(None if deadline == math.inf else deadline):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl is not None else None,
                )
        except (OSError, ssl.SSLError) as exc:
            if isinstance(exc, TimeoutError) and exc.errno is None:
                raise  # the caller's deadline, not the kernel's connect timeout
            raise ConnectFailed(f"cannot connect: {exc.__class__.__name__}") from exc
        self._open.add(conn)
        return conn

    def _put(self, conn: Connection) -> None:
        conn.idle_since = now = time.monotonic()
        idle = self._idle.setdefault(conn.origin.key, [])
        cutoff = now - self._idle_s
        while idle and idle[0].idle_since <= cutoff:  # oldest first: drop what went stale
            idle.pop(0).close()
        idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.origin.key)
        if idle and conn in idle:
            idle.remove(conn)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost
