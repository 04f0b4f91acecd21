"""A decode leg judged by its endpoint's description, against a scripted engine in process: the
terminal event ends it (what vLLM sends after ``message_stop`` is dropped), its absence is a
disconnect, and a terminal event first is ``done_before_token`` naming the event received."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient
from narwhal.engines.prefill_result import PrefillResult
from narwhal.engines.relay import Signal
from narwhal.errors import EngineError
from narwhal.settings import EngineSettings

TEXT = (b'event: content_block_delta\ndata: {"type":"content_block_delta",'
        b'"delta":{"type":"text_delta","text":"a"},"index":0}\n\n')
STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
INCOMPLETE = b'event: response.incomplete\ndata: {"type":"response.incomplete","response":{"status":"incomplete"}}\n\n'


class Ref:
    def __init__(self, url: str) -> None:
        self.name, self.url = "d0", url


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, list[bytes]]]:
    script: list[bytes] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in script:
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", answer)
    app.router.add_post("/v1/responses", answer)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), script
    await server.close()


async def _decode(url: str, endpoint: str) -> tuple[list[bytes], bool]:
    client = EngineClient.for_settings(EngineSettings(first_token_timeout_s=2, decode_read_timeout_s=2))
    result = PrefillResult(producer="p0", producer_url=url, endpoint=endpoints.BY_PATH[endpoint], request_id="r1",
                           descriptor=None, crossed=False)
    leg = client.decode_leg(result, Ref(url), {"model": "m", "stream": True}, None, stream=True)
    spans: list[bytes] = []
    try:
        assert await leg.open() is None
        while (span := await leg.next_span()) is not Signal.END:
            assert isinstance(span, bytes)
            spans.append(span)
        return spans, leg.ended
    finally:
        leg.close()
        await client.close()


async def test_message_stop_ends_the_stream_and_the_done_after_it_is_dropped(
    scripted: tuple[str, list[bytes]]
) -> None:
    url, script = scripted
    script += [TEXT, TEXT + STOP + b"data: [DONE]\n\n"]
    spans, ended = await _decode(url, "/v1/messages")
    assert b"".join(spans) == TEXT + TEXT + STOP and ended


async def test_a_done_in_its_own_chunk_after_message_stop_is_dropped_too(scripted: tuple[str, list[bytes]]) -> None:
    url, script = scripted
    script += [TEXT, STOP, b"data: [DONE]\n\n"]
    spans, _ = await _decode(url, "/v1/messages")
    assert b"".join(spans) == TEXT + STOP


async def test_a_messages_stream_without_message_stop_is_a_disconnect(scripted: tuple[str, list[bytes]]) -> None:
    url, script = scripted
    script += [TEXT, b"data: [DONE]\n\n"]  # vLLM's [DONE] is never the end of a Messages stream
    with pytest.raises(EngineError) as failed:
        await _decode(url, "/v1/messages")
    assert failed.value.reason == "engine_disconnect"
    assert str(failed.value) == "engine d0 closed the stream before message_stop"


async def test_a_terminal_event_first_names_the_event_received(scripted: tuple[str, list[bytes]]) -> None:
    url, script = scripted
    script += [INCOMPLETE]
    with pytest.raises(EngineError) as failed:
        await _decode(url, "/v1/responses")
    assert failed.value.reason == "done_before_token" and failed.value.status == 502
    assert str(failed.value) == "stream ended with response.incomplete before any token arrived"
