"""Connection.response(first_body=True) and the decode leg's open(): a stream's 200 head and its first
events are awaited in one wakeup, and every way that wait ends keeps the reason it had when the
head and the first read were two waits (first-token timeout, disconnect after the head,
unreachable before it), against scripted raw servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient
from narwhal.engines.http1 import ConnectionLost, UpstreamPool
from narwhal.engines.prefill_result import PrefillResult
from narwhal.errors import EngineError
from narwhal.reasons import Reason
from narwhal.settings import EngineSettings
from tests.unit.engines.test_http1 import RawServer, Script, serving

HEAD_200 = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOKEN = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):  # bounded: 5 s at most
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool()
    yield p
    await p.close()


async def test_a_200_head_alone_does_not_wake_the_reader_its_first_events_do(pool: UpstreamPool) -> None:
    gate = asyncio.Event()

    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(HEAD_200)
        await writer.drain()
        await gate.wait()
        writer.write(_chunk(TOKEN) + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serving(script) as (_srv, url):
        conn = await pool.post(url, "/v1/completions", b"", b"{}")
        waiting = asyncio.create_task(conn.response(first_body=True))
        await _until(lambda: conn.headers_done, "the head")
        waiter = conn._waiter
        assert waiter is not None and not waiter.done()  # the head alone woke nobody
        assert not waiting.done()
        gate.set()
        assert await waiting == 200
        assert conn.read_now() == TOKEN  # the first events are there: the next read needs no wait
        conn.close()


async def test_a_head_that_is_not_200_returns_at_once(pool: UpstreamPool) -> None:
    gate = asyncio.Event()

    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await gate.wait()
        await reader.read()

    async with serving(script) as (_srv, url):
        conn = await pool.post(url, "/v1/completions", b"", b"{}")
        assert await conn.response(first_body=True) == 503
        assert not conn.buffered and not conn.complete
        gate.set()
        conn.close()


async def test_a_200_with_an_empty_body_returns_at_its_end(pool: UpstreamPool) -> None:
    async with serving(_answer(HEAD_200 + b"0\r\n\r\n")) as (_srv, url):
        conn = await pool.post(url, "/v1/completions", b"", b"{}")
        assert await conn.response(first_body=True) == 200
        assert conn.complete and not conn.buffered
        conn.release()


async def test_a_200_lost_before_any_body_raises_with_the_head_read(pool: UpstreamPool) -> None:
    async with serving(_answer(HEAD_200, close=True)) as (_srv, url):
        conn = await pool.post(url, "/v1/completions", b"", b"{}")
        with pytest.raises(ConnectionLost):
            await conn.response(first_body=True)
        assert conn.headers_done and conn.status == 200
        conn.close()


def _answer(data: bytes, *, close: bool = False) -> Script:
    async def script(srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        if data:
            writer.write(data)
            await writer.drain()
        if not close:
            await reader.read()  # silent until the router goes away

    return script


# -- the decode leg: what each way of ending the one wait is charged as ---------------------------


class Ref:
    def __init__(self, url: str) -> None:
        self.name, self.url = "d0", url


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    engines = EngineClient.for_settings(EngineSettings(first_token_timeout_s=0.3, decode_read_timeout_s=5))
    yield engines
    await engines.close()


async def _open(client: EngineClient, url: str) -> EngineError:
    result = PrefillResult(producer="p0", producer_url=url, endpoint=endpoints.BY_PATH["/v1/completions"],
                           request_id="r1", descriptor=None, crossed=False)
    leg = client.decode_leg(result, Ref(url), {"model": "m", "prompt": "x", "stream": True}, None, stream=True)
    try:
        with pytest.raises(EngineError) as caught:
            await leg.open()
            await leg.next_span()  # open() may return with a head and no event: the read says the rest
        return caught.value
    finally:
        leg.close()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (b"", Reason.FIRST_TOKEN_TIMEOUT),  # nothing at all within the first token's bound
        (HEAD_200, Reason.FIRST_TOKEN_TIMEOUT),  # a head, then no event within the same bound
        (HEAD_200 + _chunk(b": keep-alive\n\n"), Reason.FIRST_TOKEN_TIMEOUT),  # metadata is no token
    ],
)
async def test_silence_before_the_first_token_is_a_first_token_timeout(
    client: EngineClient, answer: bytes, reason: Reason
) -> None:
    async with serving(_answer(answer)) as (_srv, url):
        error = await _open(client, url)
    assert error.reason == reason
    assert str(error) == "engine d0 sent no token within 0.3s"


@pytest.mark.parametrize(
    ("answer", "reason", "message"),
    [
        (b"", Reason.ENGINE_UNREACHABLE, "engine d0 closed the connection before a response (decode)"),
        (HEAD_200, Reason.ENGINE_DISCONNECT, "engine d0 closed the stream before [DONE]"),
        (HEAD_200 + b"0\r\n\r\n", Reason.ENGINE_DISCONNECT, "engine d0 closed the stream before [DONE]"),
    ],
)
async def test_a_connection_lost_before_or_after_the_head_keeps_its_reason(
    client: EngineClient, answer: bytes, reason: Reason, message: str
) -> None:
    async with serving(_answer(answer, close=True)) as (_srv, url):
        error = await _open(client, url)
    assert error.reason == reason
    assert str(error) == message
