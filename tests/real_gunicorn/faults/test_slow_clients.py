"""Slow clients hold a bounded share of the router's memory, in total (docs/behaviour.md
"Slow clients"; docs/behaviour.md).

Clients that send a stream request and then stop reading leave their streams waiting; each
waiting stream holds its transport buffer and a paused engine connection. With
``server.max_buffered_mib = 1``, only a few may wait at once: the next is cut at once, counted
``narwhal_slow_clients_cut_total{why="buffers_full"}``, while a client that reads is served.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import orjson
import pytest
from aiohttp import web

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    completion,
    expected_text,
    router_addr,
    scrape,
    send,
    start_router,
    unique_prompt,
    value,
    wait_until,
)
from tests.threaded_app import ThreadedApp

SLOW = 8


@pytest.fixture(scope="module")
def tight(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("tight"),
                        server={"workers": 1, "max_buffered_mib": 1, "client_write_timeout_s": 60})
    yield proc
    proc.stop()


def _slow_client(router: RouterProcess) -> socket.socket:
    """A client asking for a long stream that reads nothing after sending it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(router_addr(router))
    body = orjson.dumps(completion(unique_prompt(), max_tokens=40_000, fake={"decode": {"tokens": 40_000}}))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    return sock


async def test_slow_clients_past_the_workers_budget_are_cut_and_counted(tight: RouterProcess) -> None:
    clients = [_slow_client(tight) for _ in range(SLOW)]
    try:
        wait_until(lambda: value(scrape(tight), "narwhal_slow_clients_cut_total", why="buffers_full") >= 1, 30,
                   "a slow client cut for the worker's buffers")
        reply = await send(tight.url, "/v1/completions", completion(unique_prompt(), max_tokens=4))
        assert reply.status == 200 and reply.text == expected_text(4)  # a client that reads is served
    finally:
        for sock in clients:
            sock.close()


class BigEventEngine(ThreadedApp):
    """A vLLM-like engine (role ``both``) whose decode streams one event that never ends: a first
    chunk megabytes long (as a long prompt's logprobs make), in 64 KiB writes."""

    def __init__(self, event_bytes: int) -> None:
        self.event_bytes = event_bytes
        self.decodes = 0
        super().__init__()

    def build(self) -> web.Application:
        """Its control reads answered as a 0.33 engine serving ``MODEL``, and its completions."""
        app = web.Application()
        answers = {
            "/health": b"",
            "/version": orjson.dumps({"version": "0.33.0"}),
            "/v1/models": orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                                     "max_model_len": 4096}]}),
            "/metrics": b"",
        }

        async def control(request: web.Request) -> web.Response:
            return web.Response(body=answers[request.path], content_type="application/json")

        for path in answers:
            app.router.add_get(path, control)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):  # the same-worker prefill: one token, answered whole
            return web.json_response({
                "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "length",
                             "stop_reason": None}],
                "usage": {"prompt_tokens": 8, "total_tokens": 9, "completion_tokens": 1}})
        self.decodes += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"')
        sent = 0
        while sent < self.event_bytes:
            await resp.write(b"a" * 65536)
            sent += 65536
        for _ in range(300):  # never ends it: the router must not wait for it, and closes the connection
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.1)
        return resp


async def test_an_unfinished_event_past_the_workers_budget_ends_the_stream_uncharged(
    fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # docs/behaviour.md "Slow clients": an event the consumer has not finished counts in
    # server.max_buffered_mib; past it the decode ends as a disconnect the engine is not charged for.
    engine = BigEventEngine(event_bytes=3 << 20)
    router = start_router(fleet, [{"name": "big", "role": "both", "url": engine.url, "models": [MODEL]}],
                          tmp_path_factory.mktemp("big_event"), server={"workers": 1, "max_buffered_mib": 1})
    try:
        for _ in range(2):  # the budget was given back: the second meets the same bound, not a smaller one
            reply = await send(router.url, "/v1/completions", completion(unique_prompt(), stream=True, max_tokens=4))
            assert (reply.status, reply.headers.get("x-narwhal-error")) == (502, "engine_disconnect"), reply.raw[:300]
            assert b"server.max_buffered_mib" in reply.raw
        assert engine.decodes == 2
        scraped = scrape(router)
        assert value(scraped, "narwhal_engine_failures_total", engine="big", phase="decode",
                     reason="engine_disconnect") == 0
    finally:
        router.stop()
        engine.stop()
