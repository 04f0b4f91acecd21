"""Through real gunicorn: a request followed from the client to the engines and
back — derived backend ids on both legs, the access log's upstream ids, client address and
token counts, and the metrics an operator joins them with (model label, inter-token latency,
requests in flight and queued)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    access_line,
    at_rest,
    chat,
    completion,
    records_anywhere,
    scrape,
    send,
    settled,
    start_router,
    unique_prompt,
    value,
)

CHAT = "/v1/chat/completions"

LEGS = ["p0", "p1", "d0", "d1"]


@pytest.fixture(scope="module")
def corr(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """p0, p1 → d0, d1, one retry allowed; one decode at a time per consumer, so a test can
    make a request wait for a pair."""
    engines: list[dict[str, Any]] = [
        {"name": "p0", "role": "producer"},
        {"name": "p1", "role": "producer"},
        {"name": "d0", "role": "consumer", "max_inflight_decode": 1},
        {"name": "d1", "role": "consumer", "max_inflight_decode": 1},
    ]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("corr"), recovery={"max_retries": 1},
                        log={"level": "info"})
    yield proc
    proc.stop()


def legs(fleet: FakeFleet, prompt: str) -> list[dict[str, Any]]:
    return [rec for recs in records_anywhere(fleet, prompt, LEGS).values() for rec in recs]


async def test_backend_id_is_derived_and_logged_with_client_and_usage(corr: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    rid = "corr-" + prompt.split()[0]
    reply = await send(corr.url, "/v1/completions",
                       completion(prompt, max_tokens=5, stream_options={"include_usage": True}),
                       headers={"x-request-id": rid})
    assert reply.status == 200 and reply.headers["x-request-id"] == rid
    seen = legs(fleet, prompt)
    assert sorted(r["phase"] for r in seen) == ["decode", "prefill"]
    backend = seen[0]["headers"]["x-request-id"]
    assert seen[1]["headers"]["x-request-id"] == backend
    assert re.fullmatch(re.escape(rid) + r"-[0-9a-f]{16}-a1", backend), backend
    entry = access_line(corr, rid)
    assert entry["backend_ids"] == [backend]
    assert entry["client"] == "127.0.0.1"
    assert entry["completion_tokens"] == 5


@pytest.mark.parametrize(("traceparent", "expected"), [
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "4bf92f3577b34da6a3ce929d0e0e4736"),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", "4bf92f3577b34da6a3ce929d0e0e4736"),  # unsampled
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # all-zero trace id: invalid
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None),  # upper case: invalid
    ("garbage", None),
    (None, None),
])
async def test_with_tracing_off_the_access_log_names_the_clients_trace(
    corr: RouterProcess, fleet: FakeFleet, traceparent: str | None, expected: str | None
) -> None:
    # The trace the engines' spans join, since the header reaches them unchanged.
    prompt = unique_prompt()
    rid = "trace-" + prompt.split()[0]
    headers = {"x-request-id": rid} | ({"traceparent": traceparent} if traceparent else {})
    reply = await send(corr.url, "/v1/completions", completion(prompt, max_tokens=2), headers=headers)
    assert reply.status == 200
    entry = access_line(corr, rid)
    assert "trace_id" in entry and entry["trace_id"] == expected
    assert {r["headers"].get("traceparent") for r in legs(fleet, prompt)} == {traceparent}


@pytest.mark.parametrize(("tokens", "delay"), [(1, 0.02), (2, 0.02), (8, 0.02), (8, 0.0)])
async def test_the_usage_count_is_found_wherever_its_event_arrives(corr: RouterProcess, tokens: int,
                                                                   delay: float) -> None:
    """Paced or not, the usage event may come in the first spans (the caller's writes), through
    the direct relay, or with [DONE]: the count is the stream's in every case."""
    rid = f"usage-{tokens}-" + unique_prompt().split()[0]
    fake = {"decode": {"token_delay_s": delay}} if delay else None
    body = completion(unique_prompt(), max_tokens=tokens, stream_options={"include_usage": True}, fake=fake)
    assert (await send(corr.url, "/v1/completions", body, headers={"x-request-id": rid})).status == 200
    assert access_line(corr, rid)["completion_tokens"] == tokens


async def test_two_requests_with_one_client_id_get_distinct_backend_ids(corr: RouterProcess, fleet: FakeFleet) -> None:
    prompts = [unique_prompt(), unique_prompt()]
    for prompt in prompts:
        reply = await send(corr.url, "/v1/completions", completion(prompt), headers={"x-request-id": "same"})
        assert reply.status == 200
    ids = [legs(fleet, p)[0]["headers"]["x-request-id"] for p in prompts]
    assert ids[0] != ids[1] and all(i.startswith("same-") and i.endswith("-a1") for i in ids), ids


async def test_an_unsafe_or_long_client_id_is_cut_and_sanitised(corr: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    rid = "a b/c;" + "x" * 100  # printable, so it is the request's id, but not a safe backend one
    reply = await send(corr.url, "/v1/completions", completion(prompt, stream=False), headers={"x-request-id": rid})
    assert reply.status == 200 and reply.headers["x-request-id"] == rid
    backend = legs(fleet, prompt)[0]["headers"]["x-request-id"]
    assert re.fullmatch(r"a_b_c_" + "x" * 58 + r"-[0-9a-f]{16}-a1", backend), backend
    entry = access_line(corr, rid)
    assert entry["completion_tokens"] == 4  # the non-streaming body's usage


async def test_a_stream_without_include_usage_logs_no_token_count(corr: RouterProcess) -> None:
    rid = "nousage-" + unique_prompt().split()[0]
    reply = await send(corr.url, "/v1/completions", completion(unique_prompt()), headers={"x-request-id": rid})
    assert reply.status == 200
    assert access_line(corr, rid)["completion_tokens"] is None


async def test_a_retry_gets_the_next_attempt_id(corr: RouterProcess, fleet: FakeFleet) -> None:
    fake = {"prefill": {"status": 500, "only_engine": "p0"}}
    for _ in range(30):  # placement is random among equals: go until one lands on p0 first
        prompt = unique_prompt()
        rid = "retry-" + prompt.split()[0]
        reply = await send(corr.url, "/v1/completions", completion(prompt, fake=fake), headers={"x-request-id": rid})
        assert reply.status == 200, reply.raw
        if records_anywhere(fleet, prompt, ["p0"]):
            break
    else:
        raise AssertionError("no request was placed on p0")
    entry = access_line(corr, rid)
    assert entry["attempts"] == 2
    first, second = entry["backend_ids"]
    assert re.fullmatch(re.escape(rid) + r"-[0-9a-f]{16}-a1", first), first
    assert re.fullmatch(re.escape(rid) + r"-[0-9a-f]{16}-a2", second), second
    by_engine = {name: [r["headers"]["x-request-id"] for r in recs]
                 for name, recs in records_anywhere(fleet, prompt, LEGS).items()}
    assert by_engine["p0"] == [first] and by_engine["p1"] == [second]
    assert [ids for name, ids in by_engine.items() if name.startswith("d")] == [[second]]


async def test_requests_total_has_a_bounded_model_label(corr: RouterProcess) -> None:
    before = at_rest(corr, "narwhal_requests_total")  # the earlier tests' requests all counted
    assert (await send(corr.url, CHAT, chat(unique_prompt()))).status == 200
    body = chat(unique_prompt())
    body["model"] = "no-such-model-" + unique_prompt().split()[0]
    assert (await send(corr.url, CHAT, body)).status == 404

    def deltas() -> tuple[float, float]:
        text = scrape(corr)
        return tuple(  # type: ignore[return-value]
            value(text, "narwhal_requests_total", endpoint=CHAT, code=code, model=model)
            - value(before, "narwhal_requests_total", endpoint=CHAT, code=code, model=model)
            for code, model in (("200", MODEL), ("404", ""))
        )

    assert settled(deltas, (1.0, 1.0)) == (1.0, 1.0)
    assert body["model"] not in scrape(corr)


async def test_inter_token_histogram_takes_one_sample_per_stream(corr: RouterProcess) -> None:
    before = at_rest(corr, "narwhal_inter_token_seconds")
    body = completion(unique_prompt(), max_tokens=6, fake={"decode": {"token_delay_s": 0.02}})
    assert (await send(corr.url, "/v1/completions", body)).status == 200
    assert (await send(corr.url, "/v1/completions", completion(unique_prompt(), stream=False))).status == 200

    def count() -> float:
        name = "narwhal_inter_token_seconds_count"
        return value(scrape(corr), name) - value(before, name)

    assert settled(count, 1.0) == 1.0  # the stream only: a whole answer has no gaps
    mean = value(scrape(corr), "narwhal_inter_token_seconds_sum") - value(before, "narwhal_inter_token_seconds_sum")
    assert mean >= 0.015  # tokens 20 ms apart: the gaps between their spans are at least that


async def test_inflight_and_queued_gauges_follow_the_requests(corr: RouterProcess) -> None:
    slow = {"decode": {"token_delay_s": 0.1}}
    tasks = [asyncio.ensure_future(send(corr.url, "/v1/completions", completion(unique_prompt(), max_tokens=20,
                                                                                    fake=slow)))
             for _ in range(3)]  # two consumers, one decode each: the third waits for a pair

    def gauges() -> tuple[float, float]:
        text = scrape(corr)
        return value(text, "narwhal_requests_inflight"), value(text, "narwhal_requests_queued")

    loop = asyncio.get_running_loop()
    seen = await loop.run_in_executor(None, settled, gauges, (3.0, 1.0))
    assert seen == (3.0, 1.0)
    replies = await asyncio.gather(*tasks)
    assert [r.status for r in replies] == [200, 200, 200]
    assert await loop.run_in_executor(None, settled, gauges, (0.0, 0.0)) == (0.0, 0.0)


def test_gunicorn_own_lines_are_json_through_narwhal_formatter(corr: RouterProcess) -> None:
    """log.format = "json" (the default): gunicorn's master and worker lines are JSON objects of
    the same shape as Narwhal's own, logger ``gunicorn.error``."""
    lines = []
    with open(corr.log_path, "rb") as f:
        for raw in f.read().split(b"\n")[:-1]:  # the last piece may be a line still being written
            if b"gunicorn" in raw.lower() or b"Booting worker" in raw:
                lines.append(raw)
    assert lines
    parsed = [orjson.loads(raw) for raw in lines]  # every such line parses: none is plain text
    gunicorn = [p for p in parsed if p["logger"] == "gunicorn.error"]
    assert all(set(p) == {"ts", "level", "logger", "message"} for p in gunicorn)
    messages = [p["message"] for p in gunicorn]
    assert any(m.startswith("Starting gunicorn ") for m in messages), messages
    assert sum(m.startswith("Booting worker with pid: ") for m in messages) >= 2, messages
    assert {p["level"] for p in gunicorn} == {"info"}
