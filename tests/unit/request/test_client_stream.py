"""The client's side of a response (``request.client_stream``) on a real aiohttp server in process:
the 200 and SSE headers go out with the first token and set ``committed``; relayed spans reach
the client framed as the rest of the body; after the 200 a failure is one terminal error event;
a whole answer carries the request id; a client that stops reading is dropped within the write
bound. The same through real gunicorn: tests/real_gunicorn/faults/test_hostile_connections.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from narwhal.errors import NarwhalError
from narwhal.reasons import Reason
from narwhal.request.client_stream import ClientStream

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]
TOKEN = b'data: {"choices":[{"text":" t0"}]}\n\n'
SPAN = b'data: {"choices":[{"text":" t1"}]}\n\ndata: [DONE]\n\n'


async def _streamed(request: web.Request) -> web.StreamResponse:
    stream = ClientStream(request, "rid-1", write_timeout_s=5.0)
    assert not stream.committed
    await stream.commit_stream()
    assert stream.committed and stream.stream is stream.response
    await stream.write(TOKEN)
    assert stream.relay_sink()(SPAN) is True  # room in the buffer: the relay goes on
    await stream.write(b"", eof=True)
    stream.close()
    assert stream.response is not None
    return stream.response


MID = b'data: {"choices":[{"text":" m"}]}\n\n'


async def _written(request: web.Request) -> web.StreamResponse:
    # The head and first span through aiohttp, then caller writes (through the sink) and relayed
    # spans interleaved, then the last span with the end of the body through aiohttp again.
    stream = ClientStream(request, "rid-5", write_timeout_s=5.0)
    await stream.commit_stream()
    await stream.write(TOKEN)
    await stream.write(MID)
    assert stream.relay_sink()(MID + MID) is True
    await stream.write(MID)
    await stream.write(SPAN, eof=True)
    stream.close()
    assert stream.response is not None
    return stream.response


async def _failed(request: web.Request) -> web.StreamResponse:
    stream = ClientStream(request, "rid-2", write_timeout_s=5.0)
    await stream.commit_stream()
    await stream.write(TOKEN)
    await stream.fail(NarwhalError("decode went silent", reason=Reason.DECODE_SILENCE))
    assert stream.response is not None
    return stream.response


async def _whole(request: web.Request) -> web.StreamResponse:
    stream = ClientStream(request, "rid-3", write_timeout_s=5.0)
    return await stream.send_whole(b'{"choices":[{"text":"hi"}]}')


@pytest.fixture
async def client(aiohttp_client: ClientFactory) -> TestClient[Any, Any]:
    app = web.Application()
    app.router.add_get("/stream", _streamed)
    app.router.add_get("/fail", _failed)
    app.router.add_get("/whole", _whole)
    app.router.add_get("/written", _written)
    return await aiohttp_client(app)


async def test_the_200_goes_with_the_first_token_and_relayed_spans_follow_in_order(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.get("/stream")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream" and resp.headers["x-request-id"] == "rid-1"
    assert resp.headers["Cache-Control"] == "no-cache" and resp.headers["Transfer-Encoding"] == "chunked"
    assert await resp.read() == TOKEN + SPAN


async def test_caller_writes_after_the_first_and_relayed_spans_reach_the_client_in_order_framed_alike(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.get("/written")
    assert resp.status == 200 and resp.headers["Transfer-Encoding"] == "chunked"
    assert await resp.read() == TOKEN + MID + MID + MID + MID + SPAN


async def test_after_the_200_a_failure_is_one_terminal_error_event_without_done(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/fail")
    assert resp.status == 200
    body = await resp.read()
    assert body.startswith(TOKEN) and b"[DONE]" not in body
    event = body[len(TOKEN):]
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    error = orjson.loads(event[len(b"data: "):])["error"]
    assert error["type"] == "decode_silence" and error["message"] == "decode went silent"


async def test_a_whole_answer_carries_the_request_id(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/whole")
    assert resp.status == 200 and resp.headers["x-request-id"] == "rid-3"
    assert await resp.json() == {"choices": [{"text": "hi"}]}


async def test_a_client_that_stops_reading_is_dropped_within_the_write_bound() -> None:
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def flood(request: web.Request) -> web.StreamResponse:
        stream = ClientStream(request, "rid-4", write_timeout_s=0.3)
        await stream.commit_stream()
        try:
            for _ in range(10_000):  # 640 MB if it were read: it is not
                await stream.write(b"x" * 65536)
        except BaseException as exc:  # noqa: BLE001 - what the router sees is the point
            outcome.set_result(exc)
            raise
        outcome.set_result(None)
        return stream.response  # type: ignore[return-value]

    app = web.Application()
    app.router.add_get("/flood", flood)
    server = TestServer(app)
    await server.start_server()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", server.port or 0))
        sock.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads a byte
        exc = await asyncio.wait_for(outcome, 20)
        assert isinstance(exc, ConnectionResetError) and "stopped reading" in str(exc)
    finally:
        sock.close()
        await server.close()
