"""Streams that survive their consumer (docs/behaviour.md "Migration"), through real gunicorn.

A stream cut after visible output — its consumer closed it, sent a 5xx, fell silent, or died —
continues on another pair, and its client sees the stream an unbroken one would have been:
compared event for event with the same request served without the fault (only the response id
and ``created`` differ between two requests, so both are normalised — after checking that the
migrated stream keeps one id and one ``created`` throughout). The fake continues output exactly
(``fake_engine.continuation``), and per-request faults count tokens of the whole output, so a
continuation never meets the fault that cut the stream it continues.

Router: p0, p1 → d0, d1, one migration (``recovery.max_migrations = 1``); timeouts as the
package's (decode_read_timeout_s 1.5 s). Every module ends with no KV block held (conftest).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import anthropic
import orjson
import pytest
from openai import AsyncOpenAI

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import engines_named, faults_cleared_after_each, router_fixture
from tests.real_gunicorn.support import (
    MODEL,
    Reply,
    access_line,
    chat,
    completion,
    expected_text,
    records,
    scrape,
    send,
    terminal_error,
    unique_prompt,
    value,
    wait_until,
)

migrating = router_fixture(engines_named("p0", "p1", "d0", "d1"), "p0, p1 → d0, d1; one migration.",
                           recovery={"max_migrations": 1})
_cleared = faults_cleared_after_each("d0", "d1")

CLOSE = {"decode": {"close_after": 3}}
STREAM_5XX = {"decode": {"stream_error": {"code": 500, "message": "GPU fell off the bus", "after": 3}}}
SILENCE = {"decode": {"silence_after": 3, "silence_s": 4.0}}
CUTS = {"closed": CLOSE, "in_stream_5xx": STREAM_5XX, "silent": SILENCE}


def _normalised(reply: Reply, id_key: str = "id") -> list[Any]:
    """The stream's events with its one id and one ``created`` blanked (asserted to be one each)."""
    assert reply.status == 200, reply.raw[:300]
    events = [orjson.loads(e) if e != b"[DONE]" else "[DONE]" for e in reply.events]
    ids = {e[id_key] for e in events if isinstance(e, dict) and id_key in e}
    created = {e["created"] for e in events if isinstance(e, dict) and "created" in e}
    assert len(ids) == 1 and len(created) <= 1, (ids, created)
    for e in events:
        if isinstance(e, dict):
            e.pop(id_key, None)
            e.pop("created", None)
    return events


async def _same_as_unbroken(router: RouterProcess, path: str, body: dict[str, Any], fault: dict[str, Any],
                            id_key: str = "id") -> Reply:
    cut = await send(router.url, path, {**body, "narwhal_fake": fault})
    whole = await send(router.url, path, body)
    assert _normalised(cut, id_key) == _normalised(whole, id_key)
    return cut


@pytest.mark.parametrize("cut", sorted(CUTS))
async def test_a_cut_chat_stream_is_the_unbroken_one(migrating: RouterProcess, cut: str) -> None:
    body = chat(unique_prompt(), max_tokens=8, stream_options={"include_usage": True})
    reply = await _same_as_unbroken(migrating, "/v1/chat/completions", body, CUTS[cut])
    events = _normalised(reply)
    assert sum("role" in e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]) == 1
    assert reply.text == expected_text(8)
    assert events[-2]["usage"]["completion_tokens"] == 8  # the original prompt and every token
    line = access_line(migrating, reply.headers["x-request-id"])
    assert line["migrations"] == 1 and line["status"] == 200 and line["reason"] is None


@pytest.mark.parametrize("cut", sorted(CUTS))
async def test_a_cut_completion_stream_is_the_unbroken_one(migrating: RouterProcess, cut: str) -> None:
    reply = await _same_as_unbroken(migrating, "/v1/completions", completion(unique_prompt(), max_tokens=7),
                                    CUTS[cut])
    assert reply.text == expected_text(7)


@pytest.mark.parametrize("cut", sorted(CUTS))
async def test_a_cut_generate_stream_continues_by_tokens(migrating: RouterProcess, fleet: FakeFleet, cut: str) -> None:
    ids = [17, 4, 99, 23, 5, len(cut)]
    body = {"model": MODEL, "token_ids": ids, "stream": True, "sampling_params": {"max_tokens": 6, "min_tokens": 4},
            "stream_options": {"include_usage": True}}
    reply = await _same_as_unbroken(migrating, "/inference/v1/generate", body, CUTS[cut], id_key="request_id")
    out = [t for e in reply.events if e != b"[DONE]" for c in orjson.loads(e)["choices"] for t in c["token_ids"]]
    assert out == list(range(1000, 1006))
    decodes = [r for name in ("d0", "d1") for r in fleet.control_request("GET", f"/engines/{name}/requests")[
        "requests"] if r["phase"] == "decode" and r["body"].get("token_ids", [])[:6] == ids]
    continued = [r["body"] for r in decodes if len(r["body"]["token_ids"]) > len(ids)]
    assert continued and continued[-1]["token_ids"] == [*ids, 1000, 1001, 1002]
    assert continued[-1]["sampling_params"] == {"max_tokens": 3, "min_tokens": 1}


async def test_a_long_stream_continues_with_all_of_its_output(migrating: RouterProcess, fleet: FakeFleet) -> None:
    """200 tokens cut after 190: the transcript's older spans were compacted on the way
    (``migration.transcript``: past 16 KiB), and the continuation still carries every token."""
    prompt = unique_prompt()
    body = chat(prompt, max_tokens=200)
    reply = await _same_as_unbroken(migrating, "/v1/chat/completions", body, {"decode": {"close_after": 190}})
    assert len(reply.raw) > 2 * 16 * 1024 and reply.text == expected_text(200)
    continued = [r["body"] for name in ("d0", "d1") for r in records(fleet, name, prompt)
                 if r["phase"] == "decode" and r["body"].get("continue_final_message")]
    assert [c["messages"][-1] for c in continued] == [{"role": "assistant", "content": expected_text(190)}]


async def test_the_continuation_asks_vllm_to_continue_the_final_message(
    migrating: RouterProcess, fleet: FakeFleet
) -> None:
    prompt = unique_prompt()
    reply = await send(migrating.url, "/v1/chat/completions", chat(prompt, max_tokens=6, fake=CLOSE))
    assert reply.text == expected_text(6)
    legs = [(name, r["body"]) for name in ("d0", "d1") for r in records(fleet, name, prompt)
            if r["phase"] == "decode"]
    cut_on = next(name for name, body in legs if not body.get("continue_final_message"))
    continued_on, continued = next((name, body) for name, body in legs if body.get("continue_final_message"))
    assert continued["messages"][-1] == {"role": "assistant", "content": expected_text(3)}
    assert continued["add_generation_prompt"] is False and continued["max_tokens"] == 3
    assert continued_on != cut_on  # the consumer that cut it was avoided


def _anthropic_stream(url: str, tag: str, fault: dict[str, Any]) -> tuple[str, str | None, int, list[str]]:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kinds: list[str] = []
    with client.messages.stream(model=MODEL, max_tokens=7, system="be brief",
                                messages=[{"role": "user", "content": tag + " hello"}],
                                extra_body={"narwhal_fake": fault}) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    client.close()
    text = "".join(b.text for b in final.content if b.type == "text")
    return text, final.stop_reason, final.usage.output_tokens, kinds


@pytest.mark.parametrize("cut", sorted(CUTS))
async def test_a_cut_messages_stream_continues_through_the_chat_form(migrating: RouterProcess, cut: str) -> None:
    text, stop, output_tokens, kinds = await asyncio.to_thread(_anthropic_stream, migrating.url, uuid.uuid4().hex,
                                                               CUTS[cut])
    assert text == expected_text(7)
    assert stop == "max_tokens" and output_tokens == 7
    assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
    assert kinds[-1] == "message_stop" and kinds.count("message_delta") == 1


async def test_the_openai_sdk_reads_a_migrated_stream_whole(migrating: RouterProcess) -> None:
    client = AsyncOpenAI(base_url=migrating.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": unique_prompt()}], max_tokens=9, stream=True,
        stream_options={"include_usage": True}, extra_body={"narwhal_fake": STREAM_5XX})
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text(9)
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def _kill_its_consumer(fleet: FakeFleet, prompt: str) -> str:
    killed = next(n for n in ("d0", "d1") if any(r["phase"] == "decode" for r in records(fleet, n, prompt)))
    fleet.control_request("POST", f"/engines/{killed}/stop")
    return killed


SLOW = {"decode": {"token_delay_s": 0.1}}


async def test_a_consumer_killed_mid_stream_is_left_behind(migrating: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    client = AsyncOpenAI(base_url=migrating.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                             extra_body={"narwhal_fake": SLOW})
    text, killed = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        if killed is None and text == expected_text(3):
            killed = _kill_its_consumer(fleet, prompt)
    await client.close()
    assert text == expected_text(12)
    assert killed is not None


async def test_a_chat_whose_consumer_is_killed_reads_whole_in_the_sdk(
    migrating: RouterProcess, fleet: FakeFleet
) -> None:
    prompt = unique_prompt()
    client = AsyncOpenAI(base_url=migrating.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=10, stream=True, extra_body={"narwhal_fake": SLOW})
    text, roles, killed = "", 0, None
    async for chunk in stream:
        roles += chunk.choices[0].delta.role is not None
        text += chunk.choices[0].delta.content or ""
        if killed is None and text == expected_text(3):
            killed = _kill_its_consumer(fleet, prompt)
    await client.close()
    assert text == expected_text(10) and roles == 1 and killed is not None


def _anthropic_killed(url: str, fleet: FakeFleet, tag: str) -> tuple[str, str | None]:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    text, killed = "", None
    with client.messages.stream(model=MODEL, max_tokens=9, messages=[{"role": "user", "content": tag + " hi"}],
                                extra_body={"narwhal_fake": SLOW}) as stream:
        for piece in stream.text_stream:
            text += piece
            if killed is None and text == expected_text(3):
                killed = _kill_its_consumer(fleet, tag)
    client.close()
    return text, killed


async def test_a_messages_stream_whose_consumer_is_killed_reads_whole(
    migrating: RouterProcess, fleet: FakeFleet
) -> None:
    text, killed = await asyncio.to_thread(_anthropic_killed, migrating.url, fleet, uuid.uuid4().hex)
    assert text == expected_text(9) and killed is not None


async def test_two_cuts_with_one_migration_end_with_the_second_fault(migrating: RouterProcess) -> None:
    fault = {"decode": {"close_after": 2, "stream_error": {"code": 503, "message": "second", "after": 5}}}
    reply = await send(migrating.url, "/v1/completions", completion(unique_prompt(), max_tokens=8, fake=fault))
    assert reply.text == expected_text(5)
    assert terminal_error(reply) == {"message": "second", "type": "engine_stream_error", "param": None, "code": 503}
    assert access_line(migrating, reply.headers["x-request-id"])["migrations"] == 1


@pytest.mark.parametrize("fault", [
    {"decode": {"stream_error": {"code": 400, "message": "bad logits", "after": 2}}},
])
async def test_an_engine_4xx_in_the_stream_is_not_continued(migrating: RouterProcess, fault: dict[str, Any]) -> None:
    reply = await send(migrating.url, "/v1/chat/completions", chat(unique_prompt(), max_tokens=6, fake=fault))
    assert reply.text == expected_text(2)
    assert terminal_error(reply)["code"] == 400
    assert access_line(migrating, reply.headers["x-request-id"])["migrations"] == 0


async def test_a_responses_stream_is_not_continued(migrating: RouterProcess) -> None:
    body = {"model": MODEL, "input": unique_prompt(), "max_output_tokens": 6, "stream": True, "narwhal_fake": CLOSE}
    reply = await send(migrating.url, "/v1/responses", body)
    last = orjson.loads(reply.raw.rstrip().rsplit(b"\n\n", 1)[-1].split(b"data: ", 1)[1])
    assert reply.status == 200 and last["type"] == "error" and last["code"] == 502
    assert "closed the stream before response.completed" in last["message"]
    assert access_line(migrating, reply.headers["x-request-id"])["migrations"] == 0


def _settled_stalls(router: RouterProcess) -> float:
    """The stall count once no earlier request's observation is still on its way: the request
    path adds its histogram samples up and writes them every 0.25 s (``narwhal.metric_tally``),
    so an earlier test's stall can land after this test's first scrape. Two reads 0.3 s apart
    that agree mean every completed request's sample is in."""
    last = [value(scrape(router), "narwhal_migration_stall_seconds_count")]

    def steady() -> bool:
        time.sleep(0.3)
        now = value(scrape(router), "narwhal_migration_stall_seconds_count")
        steady, last[0] = now == last[0], now
        return steady

    wait_until(steady, 5, "the stall count settled")
    return last[0]


async def test_migrations_are_counted_with_their_stall(migrating: RouterProcess) -> None:
    before = value(scrape(migrating), "narwhal_migrations_total", reason="engine_disconnect")
    stalls = _settled_stalls(migrating)
    reply = await send(migrating.url, "/v1/completions", completion(unique_prompt(), max_tokens=6, fake=CLOSE))
    assert reply.text == expected_text(6)
    wait_until(lambda: value(scrape(migrating), "narwhal_migrations_total", reason="engine_disconnect") == before + 1,
               5, "the migration counted")
    wait_until(lambda: value(scrape(migrating), "narwhal_migration_stall_seconds_count") == stalls + 1, 5,
               "the stall observed")


async def test_no_migrations_leave_the_terminal_event(router: RouterProcess) -> None:
    """The package's routers run with ``max_migrations = 0``: docs/behaviour.md's failure table unchanged."""
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=8, fake=CLOSE))
    assert reply.text == expected_text(3)
    assert terminal_error(reply)["type"] == "engine_disconnect"


async def test_a_stream_cut_after_its_finish_is_complete_not_continued(
    migrating: RouterProcess, fleet: FakeFleet
) -> None:
    """Closed after the chunk with ``finish_reason``, before the usage chunk and ``[DONE]``: the
    client reads one finish, Narwhal's own usage chunk and ``[DONE]``; nothing is continued and
    the consumer is charged the early close."""
    prompt = unique_prompt()
    body = chat(prompt, max_tokens=5, stream_options={"include_usage": True},
                fake={"decode": {"tokens": 3, "close_after": 3}})  # "stop" after 3 tokens, then closed
    before = {name: value(scrape(migrating), "narwhal_engine_failures_total", engine=name, phase="decode",
                          reason="engine_disconnect") for name in ("d0", "d1")}
    reply = await send(migrating.url, "/v1/chat/completions", body)
    assert reply.status == 200 and reply.text == expected_text(3) and reply.events[-1] == b"[DONE]"
    events = [orjson.loads(e) for e in reply.events[:-1]]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert [f for f in finishes if f is not None] == ["stop"]
    usage = [e for e in events if not e["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 3
    assert usage[0]["usage"]["total_tokens"] == usage[0]["usage"]["prompt_tokens"] + 3 > 3
    assert usage[0]["id"] == events[0]["id"] and usage[0]["object"] == "chat.completion.chunk"
    line = access_line(migrating, reply.headers["x-request-id"])
    assert line["migrations"] == 0 and line["status"] == 200
    decodes = [n for n in ("d0", "d1") for r in records(fleet, n, prompt) if r["phase"] == "decode"]
    assert len(decodes) == 1  # never continued
    wait_until(lambda: value(scrape(migrating), "narwhal_engine_failures_total", engine=decodes[0], phase="decode",
                             reason="engine_disconnect") == before[decodes[0]] + 1, 5, "the early close charged")


async def test_the_openai_sdk_reads_a_stream_cut_after_its_finish_whole(migrating: RouterProcess) -> None:
    client = AsyncOpenAI(base_url=migrating.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt=unique_prompt(), max_tokens=4, stream=True,
                                             extra_body={"narwhal_fake": {"decode": {"tokens": 2, "close_after": 2}}})
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(2)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"structured_outputs": {"json": {"type": "object"}}},
    {"guided_regex": "[a-z ]+"},
    {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
])
async def test_constrained_output_is_never_continued(migrating: RouterProcess, extra: dict[str, Any]) -> None:
    reply = await send(migrating.url, "/v1/chat/completions", chat(unique_prompt(), max_tokens=6, fake=CLOSE, **extra))
    assert reply.status == 200 and reply.text == expected_text(3)
    assert terminal_error(reply)["type"] == "engine_disconnect"
    assert access_line(migrating, reply.headers["x-request-id"])["migrations"] == 0


async def test_a_chat_continuation_never_asks_for_echo(migrating: RouterProcess, fleet: FakeFleet) -> None:
    """vLLM's chat stream with ``echo`` first resends a final assistant message: in a
    continuation that is the output so far (``prompt_logprobs`` is refused at admission)."""
    prompt = unique_prompt()
    reply = await send(migrating.url, "/v1/chat/completions", chat(prompt, max_tokens=6, fake=CLOSE, echo=True))
    assert reply.text == expected_text(6)
    continued = [r["body"] for n in ("d0", "d1") for r in records(fleet, n, prompt)
                 if r["phase"] == "decode" and r["body"].get("continue_final_message")]
    assert len(continued) == 1 and "echo" not in continued[0]


async def test_a_continuation_refused_with_a_4xx_ends_with_the_cut(migrating: RouterProcess, fleet: FakeFleet) -> None:
    """The continuation's decode is refused (400: say its prompt, with the output, no longer
    fits): the client never sent that request, so its stream ends with the fault that cut it."""
    prompt = unique_prompt()
    slow_cut = {"decode": {"close_after": 3, "token_delay_s": 0.2}}
    body = completion(prompt, max_tokens=8, fake=slow_cut)
    task = asyncio.ensure_future(send(migrating.url, "/v1/completions", body))
    await asyncio.to_thread(wait_until, lambda: any(r["phase"] == "decode" for n in ("d0", "d1")
                                                    for r in records(fleet, n, prompt)), 10, "the decode under way")
    for name in ("d0", "d1"):  # every later decode is refused (the request's own spec sets no status)
        fleet.control_request("PUT", f"/engines/{name}/faults", {"decode": {"status": 400, "message": "too long"}})
    reply = await task
    assert reply.text == expected_text(3)
    assert terminal_error(reply)["type"] == "engine_disconnect"
    assert access_line(migrating, reply.headers["x-request-id"])["reason"] == "engine_disconnect"


lone = router_fixture(engines_named("p2", "d2"), "p2 → d2: no other consumer to continue on.",
                      recovery={"max_migrations": 1})


async def test_with_no_other_consumer_the_stream_ends_with_its_cut(lone: RouterProcess, fleet: FakeFleet) -> None:
    """A migration never goes back to the consumer that just cut the stream: with no other one
    the stream ends with the fault that cut it, recorded as that fault and not as a migration."""
    prompt = unique_prompt()
    before = value(scrape(lone), "narwhal_migrations_total", reason="engine_disconnect")
    reply = await send(lone.url, "/v1/completions", completion(prompt, max_tokens=8, fake=CLOSE))
    assert reply.text == expected_text(3)
    assert terminal_error(reply)["type"] == "engine_disconnect"
    assert [r["body"]["prompt"] for r in records(fleet, "d2", prompt)] == [prompt]
    line = access_line(lone, reply.headers["x-request-id"])
    assert line["migrations"] == 0 and line["reason"] == "engine_disconnect"
    assert value(scrape(lone), "narwhal_migrations_total", reason="engine_disconnect") == before


storm = router_fixture(engines_named("p0", "p1", "d0", "d1"), "p0, p1 → d0, d1; one migration; retry budget 3.",
                       recovery={"max_migrations": 1, "retry_budget_min": 3, "retry_budget_ratio": 0.2})


async def test_a_consumers_death_continues_every_stream_on_it(storm: RouterProcess, fleet: FakeFleet) -> None:
    """12 streams, one consumer stopped mid-stream: every stream on it continues (a migration
    never takes the retry budget, which allows 3 here)."""
    prompts = [unique_prompt() for _ in range(12)]
    slow = {"decode": {"token_delay_s": 0.15}}

    async def one(prompt: str) -> Reply:
        return await send(storm.url, "/v1/completions", completion(prompt, max_tokens=16, fake=slow))

    tasks = [asyncio.ensure_future(one(p)) for p in prompts]

    def decoding_on(name: str) -> list[str]:
        return [p for p in prompts if any(r["phase"] == "decode" for r in records(fleet, name, p))]

    await asyncio.to_thread(wait_until, lambda: len(decoding_on("d0")) + len(decoding_on("d1")) == 12, 10,
                            "every stream decoding")
    killed = max(("d0", "d1"), key=lambda name: len(decoding_on(name)))
    on_killed = decoding_on(killed)
    fleet.control_request("POST", f"/engines/{killed}/stop")
    replies = await asyncio.gather(*tasks)
    assert [r.text for r in replies] == [expected_text(16)] * 12
    assert [r.events[-1] for r in replies] == [b"[DONE]"] * 12
    migrated = [access_line(storm, r.headers["x-request-id"])["migrations"] for r in replies]
    assert sum(migrated) == len(on_killed) > 3
