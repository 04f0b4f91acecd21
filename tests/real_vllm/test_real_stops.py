"""A consumer killed mid-stream, on real engines: the client's stream ends with one terminal event.

Runs last in the tier (its module name sorts last): it kills the session's consumer. With no
migration (``recovery.max_migrations = 0``) the stream ends as docs/behaviour.md's failure table
says: the tokens so far, then ``data: {"error": {...}}`` with ``engine_disconnect`` (502), and no
``[DONE]``.
"""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from narwhal.testing.harness import RouterProcess
from tests.real_vllm.engines import MODEL, RealEngine
from tests.real_vllm.test_real_pd import prompt

pytestmark = pytest.mark.timeout(300)


async def test_a_consumer_killed_mid_stream_ends_the_stream_with_the_terminal_event(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    consumer = real_pair[1]
    body = {"model": MODEL, "prompt": prompt(), "max_tokens": 1500, "ignore_eos": True, "stream": True}
    events: list[bytes] = []
    buffer = b""
    killed = False
    async with aiohttp.ClientSession() as session:
        async with session.post(real_router.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *done, buffer = buffer.split(b"\n\n")
                events += [e.removeprefix(b"data: ") for e in done if e]
                if not killed and len(events) >= 3:
                    consumer.kill()  # SIGKILL to its whole process group, mid-stream
                    killed = True
    assert killed, events
    assert events[-1] != b"[DONE]" and b"[DONE]" not in events
    tokens = [orjson.loads(e) for e in events[:-1]]
    assert all("choices" in t for t in tokens) and len(tokens) < 1500
    error = orjson.loads(events[-1])["error"]
    assert (error["type"], error["code"]) == ("engine_disconnect", 502), error
