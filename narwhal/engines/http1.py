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
  request is never written to a connection the engine is closing, nor to one it already ended
  (``Connection.dropped``: a poll before reuse); a POST is never resent.
* a reader that does not keep up pauses the socket (``HIGH_WATER`` bytes buffered), so a slow
  client never makes the router buffer an engine's whole answer.

TCP_NODELAY is set by the event loop itself (uvloop and asyncio do it for every TCP transport);
``tests/unit/engines/test_http1.py`` checks it on the upstream sockets rather than setting it twice.

Errors are three classes, mapped to the router's reasons (``narwhal.reasons``) in exactly one place
(``engines.client``):
:class:`ConnectFailed` (nothing was sent), :class:`ConnectionLost` (the connection ended before
the whole response), :class:`ProtocolError` (bytes that are not HTTP/1.1).

Two modules: this one holds the origins, the prebuilt request heads and the pool;
``engines.http1_connection`` holds one connection (the parser callbacks, back-pressure, the
exchange's deadline) and the error classes, re-exported here with the rest of the public names.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from narwhal.engines.http1_connection import HIGH_WATER, MAX_HEAD, Connection
from narwhal.engines.http1_errors import ConnectFailed, ConnectionLost, DeadlinePassed, ProtocolError, UpstreamError

__all__ = [
    "HIGH_WATER",
    "IDLE_S",
    "MAX_HEAD",
    "ConnectFailed",
    "Connection",
    "ConnectionLost",
    "DeadlinePassed",
    "Origin",
    "ProtocolError",
    "UpstreamError",
    "UpstreamPool",
    "header_lines",
]

IDLE_S = 4.0


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
        """The origin of ``url`` (its address, TLS and request heads), made once per URL."""
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
        origin = self._origins.get(url) or self.origin(url)
        conn = self._idle_conn(origin) or await self._acquire(origin, deadline)
        conn.arm(deadline)
        size = len(body)
        head = b"".join((
            origin.head("POST", path),
            headers,
            b"Content-Type: application/json\r\nContent-Length: ",
            b"%d" % size,
            b"\r\n\r\n",
        ))
        conn.send(head, body, size)
        return conn

    async def get(self, url: str, path: str, headers: bytes, *, deadline: float | None = None) -> Connection:
        """Send ``GET path`` (no body); read the answer as for :meth:`post`."""
        origin = self.origin(url)
        conn = await self._acquire(origin, deadline)
        conn.arm(deadline)
        conn.send(b"".join((origin.head("GET", path), headers, b"\r\n")), b"")
        return conn

    def _idle_conn(self, origin: Origin) -> Connection | None:
        """A pooled connection to ``origin`` still fit for reuse, or None (synchronous: the
        usual case costs no coroutine)."""
        idle = self._idle.get(origin.key)
        if idle:
            cutoff = time.monotonic() - self._idle_s
            while idle:
                conn = idle.pop()
                if conn.reusable and conn.idle_since > cutoff and not conn.dropped():
                    return conn
                conn.close()
        return None

    async def _acquire(self, origin: Origin, deadline: float | None) -> Connection:
        conn = self._idle_conn(origin)
        if conn is not None:
            return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(None if deadline == math.inf else deadline):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, origin.key),
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
        idle = self._idle.setdefault(conn.key, [])
        cutoff = now - self._idle_s
        while idle and idle[0].idle_since <= cutoff:  # oldest first: drop what went stale
            idle.pop(0).close()
        idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    @property
    def open_connections(self) -> int:
        """Connections open now, pooled or in use."""
        return len(self._open)

    async def close(self) -> None:
        """Close every connection, idle or in use, and yield once so their ``connection_lost`` runs."""
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost
