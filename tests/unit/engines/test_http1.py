"""The lean upstream HTTP/1.1 client (narwhal.engines.http1) against scripted raw servers.

Each server answers with exact bytes, so framing (Content-Length, chunked, end of connection),
keep-alive, back-pressure and every transport failure are checked byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from narwhal.engines.http1 import (
    HIGH_WATER,
    ConnectFailed,
    ConnectionLost,
    ProtocolError,
    UpstreamPool,
    header_lines,
)

Script = Callable[["RawServer", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Accepts connections and runs ``script`` on each; records what arrived."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool()
    yield p
    await p.close()


def serve_forever(answer: bytes) -> Script:
    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await srv.read_request(reader)
            writer.write(answer)
            await writer.drain()

    return script


@contextlib.asynccontextmanager
async def serving(script: Script) -> AsyncIterator[tuple[RawServer, str]]:
    srv = RawServer(script)
    url = await srv.start()
    try:
        yield srv, url
    finally:
        await srv.stop()


OK_JSON = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def test_request_bytes_are_exact_and_the_connection_is_reused(pool: UpstreamPool) -> None:
    async with serving(serve_forever(OK_JSON)) as (srv, url):
        for rid in ("r1", "r2"):
            conn = await pool.post(url + "/base/", "/v1/completions", header_lines({"X-Request-Id": rid}), b'{"a":1}')
            assert await conn.response() == 200
            assert await conn.read_all() == b'{"ok":true}'
            conn.release()
        assert srv.connections == 1  # kept alive and reused
        assert srv.requests[1] == (
            b"POST /base/v1/completions HTTP/1.1\r\nHost: 127.0.0.1:" + url.rsplit(":", 1)[1].encode()
            + b"\r\nAccept: */*\r\nUser-Agent: narwhal\r\nX-Request-Id: r2\r\n"
            b"Content-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
        )


async def test_chunked_body_in_pieces_is_reassembled(pool: UpstreamPool) -> None:
    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        for i in range(len(wire)):  # one byte per write: every boundary
            writer.write(wire[i : i + 1])
            await writer.drain()
        await reader.read()

    async with serving(script) as (srv, url):
        conn = await pool.post(url, "/x", b"", b"{}")
        assert await conn.response() == 200
        assert await conn.read_all() == b"hello world"
        assert conn.complete
        conn.release()
        assert pool.open_connections == 1


@pytest.mark.parametrize(("head", "body"), [
    (b"Connection: close\r\n", b"all of it"),
    # "chunked" in another header, and a body that spells a Content-Length line: the body is
    # still delimited by the end of the connection (not a truncated framed body)
    (b"X-Note: chunked\r\nConnection: close\r\n", b"all of it\r\ncontent-length: 1\r\n"),
], ids=["close", "no length or chunked framing"])
async def test_a_body_delimited_by_the_end_of_the_connection_is_complete(
    pool: UpstreamPool, head: bytes, body: bytes
) -> None:
    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n" + body)
        await writer.drain()

    async with serving(script) as (srv, url):
        conn = await pool.post(url, "/x", b"", b"{}")
        assert await conn.response() == 200
        assert await conn.read_all() == body
        conn.release()
        assert pool.open_connections == 0  # never pooled


async def test_connection_close_is_not_pooled(pool: UpstreamPool) -> None:
    answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    async with serving(serve_forever(answer)) as (srv, url):
        for _ in range(2):
            conn = await pool.post(url, "/x", b"", b"{}")
            assert await conn.read_all() == b"ok"
            conn.release()
        assert srv.connections == 2


async def test_an_idle_connection_past_idle_s_is_not_reused() -> None:
    pool = UpstreamPool(idle_s=0.0)
    async with serving(serve_forever(OK_JSON)) as (srv, url):
        try:
            for _ in range(2):
                conn = await pool.post(url, "/x", b"", b"{}")
                await conn.read_all()
                conn.release()
            assert srv.connections == 2
        finally:
            await pool.close()


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_a_pooled_connection_the_engine_reset_is_not_reused(loop_kind: str) -> None:
    # The engine resets the idle connection (SO_LINGER 0: the RST goes out in close()) and the
    # next request comes before the client's loop has run: the poll before reuse sees the reset
    # and connects afresh, where the dead connection would fail "closed before a response".
    async def check() -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        pool = UpstreamPool()
        accepted: list[socket.socket] = []
        server: asyncio.Future[None] | None = None

        async def answer_one() -> None:
            engine, _ = await loop.sock_accept(listener)
            accepted.append(engine)
            await loop.sock_recv(engine, 65536)  # the whole small request
            await loop.sock_sendall(engine, OK_JSON)

        try:
            async with asyncio.timeout(5):
                server = asyncio.ensure_future(answer_one())
                conn = await pool.post(url, "/x", b"", b"{}")
                await server
                await conn.read_all()
                conn.release()
                accepted[0].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                accepted[0].close()
                server = asyncio.ensure_future(answer_one())
                conn = await pool.post(url, "/x", b"", b"{}")  # the pool is asked before any await
                status = await conn.response()  # on the dead connection: ConnectionLost
                await server
                body = await conn.read_all()
                conn.release()
                return len(accepted), body if status == 200 else b""
        finally:
            if server is not None:
                server.cancel()
            await pool.close()
            for engine in accepted[1:]:
                engine.close()
            listener.close()

    run = uvloop.run if loop_kind == "uvloop" else asyncio.run
    assert run(check()) == (2, b'{"ok":true}')


async def test_closed_before_the_response_and_mid_body_are_connection_lost(pool: UpstreamPool) -> None:
    async def before(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)

    async def mid(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        await writer.drain()

    async with serving(before) as (_, url), serving(mid) as (_, url2):
        conn = await pool.post(url, "/x", b"", b"{}")
        with pytest.raises(ConnectionLost) as info:
            await conn.response()
        assert info.value.got_headers is False
        conn.close()
        conn = await pool.post(url2, "/x", b"", b"{}")
        assert await conn.response() == 200
        assert await conn.read_some() == b"short"  # what arrived is delivered first
        with pytest.raises(ConnectionLost) as info:
            await conn.read_some()
        assert info.value.got_headers is True
        conn.close()


async def test_bytes_that_are_not_http_are_a_protocol_error(pool: UpstreamPool) -> None:
    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serving(script) as (srv, url):
        conn = await pool.post(url, "/x", b"", b"{}")
        with pytest.raises(ProtocolError):
            await conn.response()
        conn.close()


async def test_refused_is_connect_failed(pool: UpstreamPool) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(ConnectFailed):
        await pool.post(f"http://127.0.0.1:{port}", "/x", b"", b"{}")


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_upstream_sockets_have_tcp_nodelay(loop_kind: str) -> None:
    # A sync test running its own loop: production runs on uvloop, tests on asyncio's loop.
    async def check() -> int:
        pool = UpstreamPool()
        async with serving(serve_forever(OK_JSON)) as (_, url):
            try:
                conn = await pool.post(url, "/x", b"", b"{}")
                assert conn.transport is not None
                sock = conn.transport.get_extra_info("socket")
                nodelay = int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                await conn.read_all()
                conn.release()
                return nodelay
            finally:
                await pool.close()

    run = uvloop.run if loop_kind == "uvloop" else asyncio.run
    assert run(check()) != 0


async def test_a_reader_that_falls_behind_pauses_the_socket(pool: UpstreamPool) -> None:
    size = HIGH_WATER * 8

    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
        await writer.drain()
        await reader.read()

    async with serving(script) as (srv, url):
        conn = await pool.post(url, "/x", b"", b"{}")
        assert await conn.response() == 200
        transport = conn.transport
        assert transport is not None
        for _ in range(500):  # bounded wait for the buffer to pass the high-water mark
            if not transport.is_reading():
                break
            await asyncio.sleep(0.01)
        assert not transport.is_reading()
        assert len(await conn.read_all()) == size  # and reading resumes it to the end
        conn.release()


def test_header_values_with_line_breaks_are_refused() -> None:
    with pytest.raises(ValueError):
        header_lines({"traceparent": "00-a\r\nX-Evil: 1"})
    assert header_lines({"traceparent": "00-a-b-01"}) == b"traceparent: 00-a-b-01\r\n"


async def test_a_deadline_fails_the_exchange_and_closes_the_connection(pool: UpstreamPool) -> None:
    async def silent(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        await reader.read()  # never answers

    async with serving(silent) as (srv, url):
        loop = asyncio.get_running_loop()
        conn = await pool.post(url, "/x", b"", b"{}", deadline=loop.time() + 0.2)
        with pytest.raises(TimeoutError):
            await conn.response()
        assert not conn.reusable
        conn.release()  # a failed exchange is never pooled: the next one connects anew
        conn = await pool.post(url, "/x", b"", b"{}", deadline=loop.time() + 30)
        for _ in range(200):  # bounded wait for the server to accept it
            if srv.connections == 2:
                break
            await asyncio.sleep(0.01)
        assert srv.connections == 2
        conn.disarm()
        conn.close()


async def test_endless_response_headers_are_a_protocol_error(pool: UpstreamPool) -> None:
    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(2000):  # ~100 KiB of headers, never ending
            writer.write(b"X-Pad-%d: %s\r\n" % (i, b"v" * 40))
            await writer.drain()
        await reader.read()

    async with serving(script) as (srv, url):
        conn = await pool.post(url, "/x", b"", b"{}")
        with pytest.raises(ProtocolError, match="headers over"):
            await conn.response()
        conn.close()


async def test_a_sink_gets_each_read_whole_not_each_chunk(pool: UpstreamPool) -> None:
    # Engines write every SSE event as its own HTTP chunk; when several arrive in one read the
    # relay must see them as one span (one client write), in order, none lost.
    go_on, more = asyncio.Event(), asyncio.Event()
    events = [b"data: %d\n\n" % i for i in range(5)]

    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await go_on.wait()
        # One small write arrives as one read on loopback.
        writer.write(b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events))
        await writer.drain()
        await more.wait()
        writer.write(b"6\r\nlast\n\n\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serving(script) as (srv, url):
        conn = await pool.post(url, "/x", b"", b"{}")
        assert await conn.response() == 200
        got: list[bytes] = []
        conn.sink = got.append
        go_on.set()
        for _ in range(500):  # bounded waits: the first read, then the end of the body
            if got:
                break
            await asyncio.sleep(0.01)
        more.set()
        for _ in range(500):
            if conn.complete:
                break
            await asyncio.sleep(0.01)
        assert got == [b"".join(events), b"last\n\n"]
        assert conn.take() == []  # nothing left behind in the buffer
        conn.sink = None
        conn.release()
