"""The public Python API (docs/behaviour.md "The request path" "Python API"): EngineClient and PrefillResult, in
process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient, _prefill_result
from narwhal.engines.prefill_result import PrefillResult
from narwhal.errors import DeadlineExceeded, EngineClientError, EngineError
from narwhal.fake_engine import FakeEngine
from narwhal.settings import EngineSettings
from narwhal.testing.harness import DeadEngine

ENDPOINT = endpoints.COMPLETIONS
BODY = {"model": "fake-model", "prompt": " ".join(f"w{i}" for i in range(40)), "stream": True, "max_tokens": 3}


class Ref:
    def __init__(self, engine: FakeEngine) -> None:
        self.name = engine.name
        assert engine.url is not None
        self.url = engine.url


@pytest.fixture
async def engines() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    p, d = FakeEngine("p0", block_size=4), FakeEngine("d0", block_size=4)
    await p.start()
    await d.start()
    yield p, d
    await p.close()
    await d.close()


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    client = EngineClient.for_settings(
        EngineSettings(first_token_timeout_s=1, decode_read_timeout_s=0.5, prefill_timeout_s=1)
    )
    yield client
    await client.close()


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        return [span async for span in stream]


async def test_prefill_returns_a_result_and_decode_streams_it(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, d = engines
    result = await client.prefill(Ref(p), ENDPOINT, BODY, request_id="rid-1")
    assert isinstance(result, PrefillResult)
    assert (result.producer, result.endpoint, result.request_id, result.crossed) == ("p0", ENDPOINT, "rid-1", True)
    assert result.descriptor is not None and result.descriptor["remote_engine_id"] == p.engine_id
    assert p.kv.held_blocks == 10
    spans = await collect(client.decode(result, Ref(d), BODY, stream=True))
    assert b" t0" in spans[0]  # the first span holds the first generated token
    assert spans[-1].endswith(b"data: [DONE]\n\n")
    assert p.kv.held_blocks == 0


async def test_parameters_is_a_detached_copy(engines: tuple[FakeEngine, FakeEngine], client: EngineClient) -> None:
    p, d = engines
    result = await client.prefill(Ref(p), ENDPOINT, BODY, request_id="rid-2")
    params = result.parameters()
    assert params == result.descriptor
    assert params is not None
    params["remote_block_ids"][0].append(999)
    params["remote_engine_id"] = "changed"
    assert result.descriptor is not None
    assert 999 not in result.descriptor["remote_block_ids"][0]
    assert result.descriptor["remote_engine_id"] == p.engine_id
    assert await client.release(result, Ref(d), BODY) == "released"
    assert p.kv.held_blocks == 0


async def test_non_streaming_decode_yields_the_whole_body(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, d = engines
    body = {**BODY, "stream": False}
    result = await client.prefill(Ref(p), ENDPOINT, body, request_id="rid-3")
    (data,) = await collect(client.decode(result, Ref(d), body, stream=False))
    assert orjson.loads(data)["choices"][0]["text"] == " t0 t1 t2"


async def test_same_worker_prefill_has_no_descriptor(engines: tuple[FakeEngine, FakeEngine],
                                                     client: EngineClient) -> None:
    p, _ = engines
    result = await client.prefill(Ref(p), ENDPOINT, BODY, request_id="rid-4", crossed=False)
    assert result.descriptor is None and result.parameters() is None
    spans = await collect(client.decode(result, Ref(p), BODY, stream=True))
    assert spans[-1].endswith(b"data: [DONE]\n\n")
    assert p.kv.held_blocks == 0


def faulty(**faults: Any) -> dict[str, Any]:
    return {**BODY, "narwhal_fake": faults}


@pytest.mark.parametrize(
    ("faults", "reason", "status"),
    [
        ({"prefill": {"delay_headers_s": 3}}, "prefill_timeout", 504),
        ({"prefill": {"status": 502}}, "engine_5xx", 502),
        ({"decode": {"delay_first_token_s": 3}}, "first_token_timeout", 504),
        ({"decode": {"silence_after": 1, "silence_s": 3}}, "decode_silence", 504),
        ({"decode": {"done_before_token": True}}, "done_before_token", 502),
        ({"decode": {"close_after": 1}}, "engine_disconnect", 502),
        ({"decode": {"stream_error": {"code": 503, "message": "m", "after": 0}}}, "engine_stream_error", 503),
    ],
)
async def test_failures_raise_engine_errors_with_reason_and_status(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient, faults: dict, reason: str, status: int
) -> None:
    p, d = engines
    body = faulty(**faults)
    with pytest.raises(EngineError) as info:
        result = await client.prefill(Ref(p), ENDPOINT, body, request_id="rid-5")
        await collect(client.decode(result, Ref(d), body, stream=True))
    assert (info.value.reason, info.value.status) == (reason, status)
    await asyncio.sleep(0)


async def test_engine_4xx_is_a_client_error_that_does_not_count(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, _ = engines
    with pytest.raises(EngineClientError) as info:
        await client.prefill(Ref(p), ENDPOINT, {**BODY, "model": "other"}, request_id="rid-6")
    assert info.value.status == 404 and info.value.counts is False
    assert info.value.message == "The model `other` does not exist."


async def test_a_deadline_shorter_than_the_timeout_wins(engines: tuple[FakeEngine, FakeEngine],
                                                        client: EngineClient) -> None:
    p, _ = engines
    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceeded):
        await client.prefill(Ref(p), ENDPOINT, faulty(prefill={"delay_headers_s": 3}), request_id="rid-7",
                             deadline=loop.time() + 0.2)


async def test_a_cancelled_prefill_hands_its_rest_to_on_abandon(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, d = engines
    body = faulty(prefill={"delay_headers_s": 0.3})
    handed: list[Any] = []
    task = asyncio.ensure_future(
        client.prefill(Ref(p), ENDPOINT, body, request_id="rid-abandon", on_abandon=handed.append)
    )
    for _ in range(200):  # bounded wait: the producer has the request
        if p.requests_prefill:
            break
        await asyncio.sleep(0.01)
    assert p.requests_prefill == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(handed) == 1  # the rest of the prefill, not an abort
    result = await handed[0]
    assert isinstance(result, PrefillResult) and result.descriptor is not None
    assert p.kv.held_blocks == 10
    assert await client.release(result, Ref(d), body) == "released"
    assert p.kv.held_blocks == 0


async def test_passthrough_returns_status_body_and_content_type(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    _, d = engines
    status, data, content_type = await client.passthrough(
        Ref(d), "/tokenize", {"prompt": "a b"}, request_id="rid-pt", phase="decode"
    )
    assert (status, content_type) == (200, "application/json")
    assert orjson.loads(data)["count"] == 2
    (rec,) = d.get_records()
    assert rec["path"] == "/tokenize" and rec["headers"]["x-request-id"] == "rid-pt"


async def test_passthrough_relays_the_engines_own_status_and_content_type(
    aiohttp_server: Any, client: EngineClient
) -> None:
    async def pooling(request: web.Request) -> web.Response:
        return web.Response(status=201, text="plain", content_type="text/plain")

    app = web.Application()
    app.router.add_post("/pooling", pooling)
    server = await aiohttp_server(app)

    class Plain:
        name, url = "x0", str(server.make_url("")).rstrip("/")

    answer = await client.passthrough(Plain(), "/pooling", {}, request_id="r", phase="decode")
    assert answer == (201, b"plain", "text/plain; charset=utf-8")


async def test_passthrough_failures_take_the_leg_reasons(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, d = engines

    async def fail(fault: dict[str, Any], deadline: float | None = None) -> Exception:
        body = {"prompt": "x", "narwhal_fake": {"passthrough": fault}}
        with pytest.raises((EngineError, DeadlineExceeded)) as caught:
            await client.passthrough(Ref(p), "/tokenize", body, request_id="r", phase="prefill", deadline=deadline)
        return caught.value

    error = await fail({"status": 429, "message": "slow down"})
    assert isinstance(error, EngineClientError)
    assert (error.status, error.message, error.counts) == (429, "slow down", False)
    error = await fail({"status": 500})
    assert isinstance(error, EngineError)
    assert (error.reason, error.status, error.phase) == ("engine_5xx", 502, "prefill")
    error = await fail({"reset": True})
    assert isinstance(error, EngineError) and error.reason == "engine_unreachable"
    error = await fail({"delay_headers_s": 3})  # first_token_timeout_s = 1
    assert isinstance(error, EngineError) and (error.reason, error.status) == ("first_token_timeout", 504)
    assert error.message == "engine p0 sent no answer within 1s"
    error = await fail({"delay_headers_s": 3}, deadline=asyncio.get_running_loop().time() + 0.2)
    assert isinstance(error, DeadlineExceeded)
    await d.stop()
    with pytest.raises(EngineError) as caught:
        await client.passthrough(Ref(d), "/tokenize", {"prompt": "x"}, request_id="r", phase="decode")
    assert (caught.value.reason, caught.value.message) == ("engine_unreachable", "engine d0 is unreachable (decode)")
@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 300, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 256}}, (300, 256)),
        ({"prompt_tokens": 300, "completion_tokens": 1}, (300, None)),  # a miss: vLLM sends no details
        ({"prompt_tokens": 300, "prompt_tokens_details": None}, (300, None)),
        ({"prompt_tokens": "300", "prompt_tokens_details": {"cached_tokens": True}}, (None, None)),
        (None, (None, None)),
    ],
)
def test_the_prefills_prompt_and_cached_tokens_are_read(usage: Any, expected: tuple[Any, Any]) -> None:
    for crossed in (True, False):
        result = PrefillResult("p0", "http://p0", endpoints.COMPLETIONS, "r", None, crossed=crossed)
        body = orjson.dumps({"choices": [], "usage": usage, "kv_transfer_params": {"remote_engine_id": "e"}})
        _prefill_result(result, 200, body)
        assert (result.prompt_tokens, result.cached_tokens) == expected
        assert result.descriptor == ({"remote_engine_id": "e"} if crossed else None)


class Dead:
    def __init__(self, engine: DeadEngine) -> None:
        self.name, self.url = "dead", engine.url


@pytest.mark.parametrize("refusing", [True, False])
async def test_a_release_nobody_could_receive_is_unreachable_and_frees_nothing(
    engines: tuple[FakeEngine, FakeEngine], client: EngineClient, refusing: bool
) -> None:
    """Refused, or a connect that hangs past first_token_timeout_s (1 s here): nothing was sent,
    so the caller may still give the handoff to another consumer — which then frees it."""
    p, d = engines
    result = await client.prefill(Ref(p), ENDPOINT, BODY, request_id="rid-dead")
    dead = DeadEngine(refusing=refusing)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await client.release(result, Dead(dead), BODY) == "unreachable"
        assert loop.time() - started < (0.5 if refusing else 3.0)
    finally:
        dead.close()
    assert p.kv.held_blocks == 10
    assert await client.release(result, Ref(d), BODY) == "released"
    assert p.kv.held_blocks == 0


async def test_a_release_the_consumer_fails_is_failed(engines: tuple[FakeEngine, FakeEngine],
                                                      client: EngineClient) -> None:
    p, d = engines
    body = faulty(decode={"status": 500})
    result = await client.prefill(Ref(p), ENDPOINT, body, request_id="rid-500")
    assert await client.release(result, Ref(d), body) == "failed"  # it had the handoff: not retried elsewhere


class _Stalled:
    """A consumer whose every connect hangs (``DeadEngine``, not refusing): a host gone silent."""

    def __init__(self) -> None:
        self.dead = DeadEngine(refusing=False)
        self.name, self.url = "d-stalled", self.dead.url

    def close(self) -> None:
        self.dead.close()


async def test_a_decode_that_cannot_be_written_before_the_handoff_expires_is_never_written(
    engines: tuple[FakeEngine, FakeEngine]
) -> None:
    """docs/behaviour.md: the decode's connect and send are bounded by the handoff's remaining age, as a
    release's are: past it, handoff_expired (nobody's fault), not a first-token timeout later."""
    p, _ = engines
    client = EngineClient.for_settings(EngineSettings(first_token_timeout_s=5, decode_read_timeout_s=5))
    stalled = _Stalled()
    try:
        result = await client.prefill(Ref(p), ENDPOINT, BODY, request_id="rid-age")
        result.started_at -= 9.7  # 0.3 s of a 10 s max_age_s left
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineError) as failed:
            await collect(client.decode(result, stalled, BODY, stream=True, max_age_s=10.0))
        took = asyncio.get_running_loop().time() - started
        assert failed.value.reason == "handoff_expired" and failed.value.counts is False
        assert 0.2 <= took < 2.0  # the handoff's bound, not the 5 s first-token bound
    finally:
        stalled.close()
        await client.close()
