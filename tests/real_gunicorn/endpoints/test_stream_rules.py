"""docs/behaviour.md "Failure semantics" through real gunicorn: stream rules, timeouts and the exact failure mapping.

Router timeouts here (conftest.TIMEOUTS): prefill 2.5 s, first token 2.5 s, between chunks
1.5 s; ``solo_router`` has ``decode_read_timeout_s = 0``.
"""

from __future__ import annotations

import orjson
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    chat,
    completion,
    error_of,
    expected_text,
    records_anywhere,
    send,
    terminal_error,
    unique_prompt,
    wait_until,
)


async def test_done_before_any_token_is_a_502_with_the_exact_detail(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/chat/completions",
                       chat(unique_prompt(), fake={"decode": {"done_before_token": True}}))
    assert reply.status == 502
    assert reply.headers["x-narwhal-error"] == "done_before_token"
    assert error_of(reply) == {
        "message": "stream ended with [DONE] before any token arrived",
        "type": "done_before_token",
        "param": None,
        "code": 502,
    }


async def test_an_empty_completion_is_valid_not_a_fault(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), fake={"decode": {"empty": True}}))
    assert reply.status == 200
    assert reply.events[-1] == b"[DONE]"
    assert reply.text == ""


async def test_close_before_done_after_tokens_ends_with_a_terminal_event(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions",
                       completion(unique_prompt(), max_tokens=8, fake={"decode": {"close_after": 3}}))
    assert reply.status == 200
    assert reply.text == expected_text(3)
    err = terminal_error(reply)
    assert err["type"] == "engine_disconnect" and err["code"] == 502
    assert err["message"].startswith("engine d") and "closed the stream before [DONE]" in err["message"]


async def test_close_before_the_first_token_is_a_502(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions",
                       completion(unique_prompt(), fake={"decode": {"close_after": 0}}))
    assert reply.status == 502
    assert reply.headers["x-narwhal-error"] == "engine_disconnect"
    assert error_of(reply)["type"] == "engine_disconnect"


@pytest.mark.parametrize(("code", "status"), [(503, 503), (500, 500), (429, 429), (None, 502), (200, 502)])
async def test_in_stream_error_before_a_token_takes_its_own_status(
    router: RouterProcess, code: int | None, status: int
) -> None:
    fake = {"decode": {"stream_error": {"code": code, "message": "engine says no", "after": 0}}}
    reply = await send(router.url, "/v1/chat/completions", chat(unique_prompt(), fake=fake))
    assert reply.status == status
    assert reply.headers["x-narwhal-error"] == "engine_stream_error"
    assert error_of(reply) == {"message": "engine says no", "type": "engine_stream_error", "param": None,
                               "code": status}


async def test_flat_in_stream_error_is_recognised(router: RouterProcess) -> None:
    fake = {"decode": {"stream_error": {"code": 500, "message": "old style", "after": 0, "flat": True}}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), fake=fake))
    assert reply.status == 500
    assert error_of(reply)["message"] == "old style"


async def test_in_stream_error_after_tokens_is_the_terminal_event(router: RouterProcess) -> None:
    fake = {"decode": {"stream_error": {"code": 500, "message": "KV load failed", "after": 2}}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=6, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(2)
    assert terminal_error(reply) == {"message": "KV load failed", "type": "engine_stream_error", "param": None,
                                     "code": 500}


async def test_first_token_timeout_is_a_504(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions",
                       completion(unique_prompt(), fake={"decode": {"delay_first_token_s": 6}}))
    assert reply.status == 504
    assert reply.headers["x-narwhal-error"] == "first_token_timeout"
    assert error_of(reply)["type"] == "first_token_timeout"


async def test_first_token_timeout_includes_the_wait_for_response_headers(router: RouterProcess) -> None:
    # Headers after 1.5 s, first token 1.5 s later: each alone is under the 2.5 s budget.
    fake = {"decode": {"delay_headers_s": 1.5, "delay_first_token_s": 1.5}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), fake=fake))
    assert reply.status == 504
    assert error_of(reply)["type"] == "first_token_timeout"


async def test_silence_between_tokens_ends_the_stream_with_a_504_event(router: RouterProcess) -> None:
    fake = {"decode": {"silence_after": 2, "silence_s": 5}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=5, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(2)
    err = terminal_error(reply)
    assert err["type"] == "decode_silence" and err["code"] == 504
    assert err["message"].startswith("engine went silent between tokens")


async def test_metadata_resets_the_silence_timer(router: RouterProcess) -> None:
    # 3 s of silence in tokens, but a metadata event every 0.5 s: never 1.5 s without data.
    fake = {"decode": {"silence_after": 2, "silence_s": 3, "heartbeat_s": 0.5}}
    reply = await send(router.url, "/v1/chat/completions", chat(unique_prompt(), max_tokens=4, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(4)
    assert reply.events[-1] == b"[DONE]"


async def test_decode_read_timeout_zero_bounds_only_by_the_deadline(solo_router: RouterProcess) -> None:
    fake = {"decode": {"silence_after": 1, "silence_s": 2}}
    reply = await send(solo_router.url, "/v1/completions", completion(unique_prompt(), max_tokens=3, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(3)
    # ... and the request deadline still ends it: here the client asks for 1 s.
    reply = await send(solo_router.url, "/v1/completions", completion(unique_prompt(), max_tokens=3, fake=fake),
                       headers={"x-narwhal-deadline-s": "1"})
    assert reply.status == 200
    err = terminal_error(reply)
    assert err["type"] == "deadline_exceeded" and err["code"] == 504
    assert err["message"] == "the request deadline ran out while decoding (the request's deadline: 1s)"


async def test_prefill_timeout_is_a_504(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions",
                       completion(unique_prompt(), fake={"prefill": {"delay_headers_s": 5}}))
    assert reply.status == 504
    assert reply.headers["x-narwhal-error"] == "prefill_timeout"


async def test_deadline_before_the_first_token_is_a_504(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions",
                       completion(unique_prompt(), fake={"decode": {"delay_first_token_s": 2}}),
                       headers={"x-narwhal-deadline-s": "0.8"})
    assert reply.status == 504
    assert reply.headers["x-narwhal-error"] == "deadline_exceeded"
    assert error_of(reply)["message"].endswith("(the request's deadline: 0.8s)")  # the bound and its value


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_engine_5xx_is_a_502_with_no_retry_by_default(
    router: RouterProcess, fleet: FakeFleet, phase: str
) -> None:
    prompt = unique_prompt()
    reply = await send(router.url, "/v1/completions",
                       completion(prompt, fake={phase: {"status": 500, "message": "boom"}}))
    assert reply.status == 502
    assert reply.headers["x-narwhal-error"] == "engine_5xx"
    assert error_of(reply)["code"] == 502
    # recovery.max_retries = 0: exactly one prefill (and at most one decode) was tried.
    prefills = records_anywhere(fleet, prompt, ["p0", "p1"])
    assert sum(len(recs) for recs in prefills.values()) == 1
    assert sum(len(recs) for recs in records_anywhere(fleet, prompt, ["d0", "d1"]).values()) == (phase == "decode")


@pytest.mark.parametrize(("phase", "status", "flat"), [("prefill", 400, True), ("decode", 429, False),
                                                       ("decode", 404, True)])
async def test_engine_4xx_is_passed_through(router: RouterProcess, phase: str, status: int, flat: bool) -> None:
    fake = {phase: {"status": status, "message": "engine refused this", "flat_error": flat}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), fake=fake))
    assert reply.status == status
    assert reply.headers["x-narwhal-error"] == "engine_client_error"
    assert error_of(reply) == {"message": "engine refused this", "type": "engine_client_error", "param": None,
                               "code": status}


async def test_unreachable_engine_is_a_502_naming_it_without_its_address(
    solo_router: RouterProcess, fleet: FakeFleet
) -> None:
    fleet.control_request("POST", "/engines/p2/stop")
    try:
        reply = await send(solo_router.url, "/v1/completions", completion(unique_prompt()))
    finally:
        fleet.control_request("POST", "/engines/p2/start")
    assert reply.status == 502
    assert reply.headers["x-narwhal-error"] == "engine_unreachable"
    err = error_of(reply)
    assert "p2" in err["message"] and "127.0.0.1" not in err["message"]
    wait_until(lambda: fleet.stats("p2")["url"] is not None, 5, "p2 listening again")
    reply = await send(solo_router.url, "/v1/completions", completion(unique_prompt()))
    assert reply.status == 200


async def test_a_long_think_is_generated_output_not_a_first_token_timeout(router: RouterProcess) -> None:
    # A reasoning model thinks before it answers: 8 reasoning deltas 0.4 s apart outlast the
    # 2.5 s first-token timeout. Reasoning is generated output (``delta.reasoning``, vLLM 0.2x
    # on): the 200 goes out with the first of them, and the stream is relayed whole.
    fake = {"decode": {"reasoning": 8, "token_delay_s": 0.4}}
    reply = await send(router.url, "/v1/chat/completions", chat(unique_prompt(), max_tokens=10, fake=fake))
    assert reply.status == 200, reply.raw
    chunks = [orjson.loads(e) for e in reply.events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert [d["reasoning"] for d in deltas if "reasoning" in d] == [f" t{i}" for i in range(8)]
    assert "".join(d.get("content") or "" for d in deltas) == " t8 t9"
    assert reply.events[-1] == b"[DONE]"
