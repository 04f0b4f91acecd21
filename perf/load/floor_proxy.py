"""The aiohttp floor: the cheapest PD proxy this stack allows, as a perf target.

gunicorn + aiohttp (uvloop) + Narwhal's own engine client, and nothing else: parse the body,
prefill on the one producer, decode on the one consumer, write what comes back. No admission
checks, placement, reservations, shared state, breakers, timeouts beyond the client's own,
metrics or error shapes. What it adds over ``direct-pd`` is what the framework costs; what
Narwhal adds over it is what Narwhal's features cost. Not a router: any failure is a 500.

Run by the suite as ``gunicorn -c /dev/null perf.load.floor_proxy:app`` with the engines' URLs
in ``FLOOR_PRODUCER`` / ``FLOOR_CONSUMER`` (``-c /dev/null``: not Narwhal's gunicorn.conf.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass

import orjson
from aiohttp import web

from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient
from narwhal.settings import EngineSettings


@dataclass
class _Engine:
    name: str
    url: str


_IDS = itertools.count()
_CLIENT = web.AppKey("client", EngineClient)
_PRODUCER = web.AppKey("producer", _Engine)
_CONSUMER = web.AppKey("consumer", _Engine)


async def _completions(request: web.Request) -> web.StreamResponse:
    client = request.app[_CLIENT]
    body = orjson.loads(await request.read())
    endpoint = endpoints.of(request.path)
    result = await client.prefill(request.app[_PRODUCER], endpoint, body, request_id=f"f{os.getpid()}-{next(_IDS)}")
    stream = bool(body.get("stream"))
    response: web.StreamResponse | None = None
    chunks = client.decode(result, request.app[_CONSUMER], body, stream=stream)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if not stream:
                return web.Response(body=chunk, content_type="application/json")
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
            await response.write(chunk)
    assert response is not None
    await response.write_eof()
    return response


async def app() -> web.Application:
    application = web.Application()
    application[_PRODUCER] = _Engine("p0", os.environ["FLOOR_PRODUCER"])
    application[_CONSUMER] = _Engine("d0", os.environ["FLOOR_CONSUMER"])
    application[_CLIENT] = EngineClient.for_settings(EngineSettings())
    application.router.add_post("/v1/completions", _completions)
    application.router.add_post("/v1/chat/completions", _completions)
    return application
