"""The other P/D endpoints through real gunicorn (docs/behaviour.md "The other P/D endpoints"): /v1/messages,
/v1/responses and
/inference/v1/generate on the same request path as chat, each judged by its own stream rules.

Every test runs on a fleet of each vLLM release that hands off on these endpoints (0.32.0, then
0.33.0): 0.11.0 hands off only on chat and completions, and what Narwhal does with these
endpoints there (501, or the consumer alone) is test_releases.py's. Router timeouts
(support.TIMEOUTS): prefill 2.5 s, first token 2.5 s, between chunks 1.5 s. The module's end
checks that no producer still holds KV blocks (conftest).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import aiohttp
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.endpoints_support import ALL, GENERATE, MESSAGES, RESPONSES, Endpoint, last_event, sse_events
from tests.real_gunicorn.fixtures import release_fleet
from tests.real_gunicorn.support import (
    ENGINES,
    Reply,
    access_line,
    expected_text,
    records_anywhere,
    scrape,
    send,
    settled,
    value,
    wait_until,
)

IDS = [e.path for e in ALL]

fleet = release_fleet(releases=["0.32.0", "0.33.0"])


def _legs(fleet: FakeFleet, tag: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The one prefill and the one decode a request caused, and the producer's name."""
    found = records_anywhere(fleet, tag, ENGINES)
    prefills = [(n, r) for n, recs in found.items() for r in recs if r["phase"] == "prefill"]
    decodes = [(n, r) for n, recs in found.items() for r in recs if r["phase"] == "decode"]
    assert len(prefills) == 1 and len(decodes) == 1, found
    return prefills[0][1], decodes[0][1], prefills[0][0]


async def _direct(fleet: FakeFleet, consumer_url: str, path: str, body: dict, request_id: str) -> bytes:
    """What the consumer sends for this decode body, asked directly (no descriptor: nothing to pull)."""
    plain = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    reply = await send(consumer_url, path, plain, headers={"X-Request-Id": request_id})
    assert reply.status == 200, reply.raw
    return reply.raw


def _error_answer(reply: Reply, ep: Endpoint, status: int, reason: str) -> str:
    """``reply`` is ``ep``'s HTTP error: ``status``, ``x-narwhal-error: reason`` and the body in
    the endpoint's shape; its message is returned for the test to judge."""
    assert reply.status == status
    assert reply.headers["x-narwhal-error"] == reason
    message: str = reply.json.get("error", {}).get("message")
    assert reply.json == ep.error(status, reason, message)
    return message


def _terminal_error(reply: Reply, ep: Endpoint, status: int, reason: str) -> str:
    """``reply``'s stream ends in ``ep``'s terminal error event for ``status`` and ``reason``; its
    message is returned for the test to judge."""
    name, data = last_event(reply)
    message: str = (data.get("error") or {}).get("message") or data.get("message")
    assert (name, data) == ep.terminal_error(status, reason, message)
    return message


def _timeless(raw: bytes) -> bytes:
    return re.sub(rb'"created_at":\d+', b'"created_at":0', raw)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_both_legs_get_the_exact_bodies_and_the_client_gets_the_decode_unchanged(
    router: RouterProcess, fleet: FakeFleet, ep: Endpoint, stream: bool
) -> None:
    tag = uuid.uuid4().hex
    client_kv = {"do_remote_prefill": True, "remote_engine_id": "forged", "remote_block_ids": [1]}
    body = ep.body(tag, stream=stream, max_tokens=5, kv_transfer_params=client_kv, request_id="client-id")
    reply = await send(router.url, ep.path, body)
    assert reply.status == 200, reply.raw
    prefill, decode, producer = _legs(fleet, tag)
    request_id = prefill["headers"]["x-request-id"]
    assert decode["headers"]["x-request-id"] == request_id
    clean = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert prefill["body"] == ep.prefill_of(clean, request_id)
    descriptor = decode["body"]["kv_transfer_params"]
    assert descriptor["remote_engine_id"] == fleet.stats(producer)["engine_id"] != "forged"
    assert descriptor["do_remote_prefill"] is True
    expected_decode = {**clean, "kv_transfer_params": descriptor}
    if ep is RESPONSES:
        # Both legs carry the backend id, not the client's, as a Response id: vLLM's resp_ prefix.
        expected_decode["request_id"] = "resp_" + request_id
    assert decode["body"] == expected_decode
    consumer = next(n for n, recs in records_anywhere(fleet, tag, ENGINES).items()
                    if any(r["phase"] == "decode" for r in recs))
    direct = await _direct(fleet, fleet.engines[consumer], ep.path, decode["body"], request_id)
    if stream and ep is MESSAGES:
        # vLLM's [DONE] after message_stop is not Anthropic's protocol: the router drops it.
        assert direct.endswith(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\ndata: [DONE]\n\n")
        direct = direct[: -len(b"data: [DONE]\n\n")]
    assert _timeless(reply.raw) == _timeless(direct)
    if stream:
        assert ep.text(reply.raw) == expected_text(5)
        assert reply.headers["Content-Type"].startswith("text/event-stream")
    wait_until(lambda: fleet.stats(producer)["held_blocks"] == 0, 10, "the producer's blocks released")


@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_terminal_event_before_any_output_is_a_502_with_the_exact_detail(
    router: RouterProcess, ep: Endpoint
) -> None:
    reply = await send(router.url, ep.path, ep.body(uuid.uuid4().hex, fake={"decode": {"done_before_token": True}}))
    assert reply.status == 502
    assert reply.headers["x-narwhal-error"] == "done_before_token"
    detail = f"stream ended with {ep.terminal} before any token arrived"
    assert reply.json == ep.error(502, "done_before_token", detail)


@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_an_immediate_end_of_sequence_is_a_valid_empty_answer(router: RouterProcess, ep: Endpoint) -> None:
    reply = await send(router.url, ep.path, ep.body(uuid.uuid4().hex, fake={"decode": {"empty": True}}))
    assert reply.status == 200, reply.raw
    assert ep.text(reply.raw) == ""
    name, data = last_event(reply)
    assert (name or data) == ep.terminal


@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_close_before_the_terminal_event_after_output_ends_with_one_terminal_error(
    router: RouterProcess, ep: Endpoint
) -> None:
    fake = {"decode": {"close_after": 3}}
    reply = await send(router.url, ep.path, ep.body(uuid.uuid4().hex, max_tokens=8, fake=fake))
    assert reply.status == 200
    assert ep.text(reply.raw) == expected_text(3)
    message = _terminal_error(reply, ep, 502, "engine_disconnect")
    assert re.fullmatch(rf"engine d\d closed the stream before {re.escape(ep.terminal)}", message)
    event = last_event(reply)
    assert [e for e in sse_events(reply.raw) if e == event] == [event]


@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_close_before_any_output_is_a_502_in_the_endpoint_shape(router: RouterProcess, ep: Endpoint) -> None:
    reply = await send(router.url, ep.path, ep.body(uuid.uuid4().hex, fake={"decode": {"close_after": 0}}))
    _error_answer(reply, ep, 502, "engine_disconnect")


@pytest.mark.parametrize(("code", "status"), [(503, 503), (429, 429), (400, 400), (None, 502)])
@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_in_stream_error_before_output_is_an_http_error_with_its_status(
    router: RouterProcess, ep: Endpoint, code: int | None, status: int
) -> None:
    fake = {"decode": {"stream_error": {"code": code, "message": "engine says no", "after": 0}}}
    reply = await send(router.url, ep.path, ep.body(uuid.uuid4().hex, fake=fake))
    assert _error_answer(reply, ep, status, "engine_stream_error") == "engine says no"


@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_in_stream_error_after_output_is_one_terminal_event_in_the_endpoint_shape(
    router: RouterProcess, ep: Endpoint
) -> None:
    fake = {"decode": {"stream_error": {"code": 500, "message": "KV load failed", "after": 2}}}
    reply = await send(router.url, ep.path, ep.body(uuid.uuid4().hex, max_tokens=6, fake=fake))
    assert reply.status == 200
    assert ep.text(reply.raw) == expected_text(2)
    assert last_event(reply) == ep.terminal_error(500, "engine_stream_error", "KV load failed")
    assert "[DONE]" not in [d for _, d in sse_events(reply.raw)]


@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_the_other_error_shape_inside_the_stream_is_understood(router: RouterProcess, ep: Endpoint) -> None:
    # messages: OpenAI's {"error": ...}; responses: response.failed; generate: vLLM's old flat form.
    fake = {"decode": {"stream_error": {"code": 503, "message": "busy", "after": 0, "flat": True}}}
    reply = await send(router.url, ep.path, ep.body(uuid.uuid4().hex, fake=fake))
    assert reply.status == 503
    assert reply.json == ep.error(503, "engine_stream_error", "busy")


# The two timeout tests send every endpoint's request at once: each waits out a router timeout,
# and one wait for all of them is the suite's time, not three.

async def test_silence_between_tokens_ends_the_stream_with_a_504_event(router: RouterProcess) -> None:
    fake = {"decode": {"silence_after": 2, "silence_s": 5}}
    replies = await asyncio.gather(*(send(router.url, ep.path, ep.body(uuid.uuid4().hex, max_tokens=5, fake=fake))
                                     for ep in ALL))
    for ep, reply in zip(ALL, replies, strict=True):
        assert reply.status == 200, ep.path
        assert ep.text(reply.raw) == expected_text(2), ep.path
        assert _terminal_error(reply, ep, 504, "decode_silence").startswith("engine went silent between tokens")


async def test_first_token_timeout_is_a_504_in_the_endpoint_shape(router: RouterProcess) -> None:
    fake = {"decode": {"delay_first_token_s": 6}}
    replies = await asyncio.gather(*(send(router.url, ep.path, ep.body(uuid.uuid4().hex, fake=fake)) for ep in ALL))
    for ep, reply in zip(ALL, replies, strict=True):
        assert _error_answer(reply, ep, 504, "first_token_timeout").endswith("sent no token within 2.5s"), ep.path


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [("previous_response_id", "resp_1", "lives inside one engine process"), ("background", True, "no stream to relay")],
)
async def test_responses_refuses_what_disaggregation_cannot_honour(
    router: RouterProcess, fleet: FakeFleet, field: str, value: Any, why: str
) -> None:
    tag = uuid.uuid4().hex
    reply = await send(router.url, RESPONSES.path, RESPONSES.body(tag, **{field: value}))
    assert reply.status == 400
    assert reply.headers["x-narwhal-error"] == "bad_request"
    error = reply.json["error"]
    assert error["type"] == "bad_request" and error["code"] == 400
    assert field in error["message"] and why in error["message"]
    assert records_anywhere(fleet, tag, ENGINES) == {}


@pytest.mark.parametrize(
    ("ep", "change", "message"),
    [
        (MESSAGES, {"messages": "hi"}, "'messages' must be a list of objects"),
        (MESSAGES, {"max_tokens": None}, "'max_tokens' is required"),
        (MESSAGES, {"stream": "yes"}, "'stream' must be a boolean"),
        (RESPONSES, {"input": 5}, "'input' must be a string or a list of input items"),
        (RESPONSES, {"max_output_tokens": -1}, "'max_output_tokens' must be an integer >= 0"),
        (GENERATE, {"token_ids": ["a"]}, "'token_ids' must be a non-empty list of token ids"),
        (GENERATE, {"sampling_params": {"max_tokens": "x"}}, "'sampling_params.max_tokens' must be an integer >= 0"),
        (GENERATE, {"sampling_params": {"n": 2}}, "'sampling_params.n' > 1 is not supported by disaggregated serving"),
    ],
    ids=lambda v: v.path if isinstance(v, Endpoint) else None,
)
async def test_wrong_field_types_are_400_in_the_endpoint_shape(
    router: RouterProcess, ep: Endpoint, change: dict, message: str
) -> None:
    body = ep.body(uuid.uuid4().hex)
    body.update(change)
    reply = await send(router.url, ep.path, body)
    assert reply.status == 400
    assert reply.headers["x-narwhal-error"] == "bad_request"
    assert reply.json == ep.error(400, "bad_request", message)


async def test_messages_errors_of_the_router_are_anthropic_shaped(router: RouterProcess) -> None:
    reply = await send(router.url, MESSAGES.path, MESSAGES.body("x", model="no-such-model"))
    assert reply.status == 404 and reply.headers["x-narwhal-error"] == "model_not_found"
    assert reply.json == {"type": "error", "error": {"type": "not_found_error",
                                                     "message": "The model `no-such-model` does not exist."}}
    reply = await send(router.url, MESSAGES.path, raw=b"{not json")
    assert reply.status == 400 and reply.json["type"] == "error"
    assert reply.json["error"]["type"] == "invalid_request_error"
    reply = await send(router.url, MESSAGES.path, raw=b"{}", headers={"Content-Type": "text/plain"})
    assert reply.status == 415 and reply.json["error"]["type"] == "invalid_request_error"
    reply = await send(router.url, MESSAGES.path, method="GET")
    assert reply.status == 405 and reply.headers["x-narwhal-error"] == "method_not_allowed"
    assert reply.json["type"] == "error" and reply.json["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("kind", "status"), [(503, 503), (429, 429), (400, 400), (500, 502)])
async def test_messages_engine_error_types_map_to_statuses(router: RouterProcess, kind: int, status: int) -> None:
    # The fake writes overloaded_error, rate_limit_error, invalid_request_error, internal_error.
    fake = {"decode": {"stream_error": {"code": kind, "message": "typed", "after": 0}}}
    reply = await send(router.url, MESSAGES.path, MESSAGES.body(uuid.uuid4().hex, fake=fake))
    assert reply.status == status
    assert reply.json == MESSAGES.error(status, "engine_stream_error", "typed")


async def test_messages_engine_4xx_in_anthropic_shape_passes_through(router: RouterProcess) -> None:
    # The consumer's own refusal, which a one-token release of the handoff does not repeat: on 0.11
    # Narwhal's release frees the blocks, on 0.33 the consumer does (docs/decisions.md "vLLM
    # releases"); the module's end checks no producer holds any.
    fault = {"decode": {"status": 400, "message": "bad stop sequence", "streams_only": True}}
    reply = await send(router.url, MESSAGES.path, MESSAGES.body(uuid.uuid4().hex, fake=fault))
    assert reply.status == 400
    assert reply.headers["x-narwhal-error"] == "engine_client_error"
    assert reply.json["type"] == "error" and reply.json["error"]["type"] == "invalid_request_error"
    assert reply.json["error"]["message"] == "bad stop sequence"


async def test_messages_limit_past_the_context_is_refused_at_admission_in_anthropic_shape(
    router: RouterProcess
) -> None:
    # max_tokens beyond the context: the one-token prefill would pass and the consumer refuse it
    # after a handoff exists; the router refuses it first, with vLLM's message (0.12 on).
    reply = await send(router.url, MESSAGES.path, MESSAGES.body(uuid.uuid4().hex, max_tokens=2_000_000))
    assert reply.status == 400 and reply.headers["x-narwhal-error"] == "bad_request"
    assert reply.json["type"] == "error" and reply.json["error"]["type"] == "invalid_request_error"
    assert reply.json["error"]["message"].startswith("max_tokens=2000000 cannot be greater than max_model_len=")


async def test_generate_prefill_rewrites_sampling_params(router: RouterProcess, fleet: FakeFleet) -> None:
    tag = uuid.uuid4().hex
    body = GENERATE.body(tag, stream_options={"include_usage": True})
    body["sampling_params"].update(min_tokens=2, stop=["x"], stop_token_ids=[7])
    reply = await send(router.url, GENERATE.path, body)
    assert reply.status == 200, reply.raw
    prefill, decode, _ = _legs(fleet, tag)
    assert prefill["body"]["sampling_params"] == {"max_tokens": 1, "temperature": 0}
    assert "stream_options" not in prefill["body"] and prefill["body"]["stream"] is False
    assert decode["body"]["sampling_params"] == body["sampling_params"]
    assert decode["body"]["stream_options"] == {"include_usage": True}


async def test_messages_prefill_drops_stop_sequences(router: RouterProcess, fleet: FakeFleet) -> None:
    tag = uuid.uuid4().hex
    body = MESSAGES.body(tag, stop_sequences=["\n\nHuman:"])
    reply = await send(router.url, MESSAGES.path, body)
    assert reply.status == 200, reply.raw
    prefill, decode, _ = _legs(fleet, tag)
    assert "stop_sequences" not in prefill["body"] and prefill["body"]["max_tokens"] == 1
    assert decode["body"]["stop_sequences"] == ["\n\nHuman:"]
    assert decode["body"]["max_tokens"] == 4


@pytest.mark.parametrize("ep", ALL, ids=IDS)
async def test_a_same_worker_decode_sends_no_transfer_parameters(
    same_router: RouterProcess, fleet: FakeFleet, ep: Endpoint
) -> None:
    tag = uuid.uuid4().hex
    reply = await send(same_router.url, ep.path, ep.body(tag, max_tokens=3))
    assert reply.status == 200, reply.raw
    assert ep.text(reply.raw) == expected_text(3)
    legs = records_anywhere(fleet, tag, ENGINES)
    assert set(legs) == {"b0"} and len(legs["b0"]) == 2
    warm, decode = legs["b0"]
    assert all("kv_transfer_params" not in r["body"] for r in (warm, decode))
    assert warm["body"]["stream"] is False and decode["body"]["stream"] is True



@pytest.mark.parametrize(("code", "status", "counted"), [(503, 503, 1.0), (None, 502, 1.0), (400, 400, 0.0)])
async def test_a_responses_prefill_that_failed_is_the_engines_error_not_a_bad_handoff(
    solo_router: RouterProcess, fleet: FakeFleet, code: int | None, status: int, counted: float
) -> None:
    # A 200 Response with "status": "failed" once became invalid_handoff (no
    # descriptor in it), charged to the producer as a bad handoff. It is the engine's own error,
    # mapped as an in-stream one (docs/behaviour.md "The other P/D endpoints"): its code or 502; counted against p2
    # only when 5xx.
    def failures() -> tuple[float, float]:
        text = scrape(solo_router)
        return tuple(  # type: ignore[return-value]
            value(text, "narwhal_engine_failures_total", engine="p2", phase="prefill", reason=reason)
            for reason in ("engine_stream_error", "invalid_handoff")
        )

    before = failures()
    tag = uuid.uuid4().hex
    rid = "failed-" + tag
    fake = {"prefill": {"failed": {"code": code, "message": "generation failed"}}}
    url = solo_router.url + RESPONSES.path
    async with aiohttp.ClientSession() as session:  # one connection: one worker, in order
        async with session.post(url, json=RESPONSES.body(tag, fake=fake), headers={"x-request-id": rid}) as resp:
            assert resp.status == status, await resp.read()
            assert resp.headers["x-narwhal-error"] == "engine_stream_error"
            assert await resp.json() == RESPONSES.error(status, "engine_stream_error", "generation failed")
        # A counted one after it on the same worker: once it shows, so would the first have.
        marker = {"prefill": {"failed": {"code": 500, "message": "marker"}}}
        async with session.post(url, json=RESPONSES.body(uuid.uuid4().hex, fake=marker)) as resp:
            assert resp.status == 500
    found = records_anywhere(fleet, tag, ENGINES)
    assert [(name, r["phase"]) for name, recs in found.items() for r in recs] == [("p2", "prefill")]  # no decode
    entry = access_line(solo_router, rid)
    assert (entry["reason"], entry["producer"], entry["status"]) == ("engine_stream_error", "p2", status)
    expected = (before[0] + counted + 1, before[1])
    assert settled(failures, expected) == expected
