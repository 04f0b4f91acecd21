"""docs/behaviour.md "The request path" through real gunicorn (2 workers) and real fake engines over HTTP."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import orjson
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.fixtures import engines_named, release_fleet, router_fixture
from tests.real_gunicorn.support import (
    MODEL,
    at_rest,
    chat,
    completion,
    error_of,
    expected_text,
    records,
    records_anywhere,
    scrape,
    send,
    unique_prompt,
    value,
    wait_until,
)
from tests.wire import PREFILL_KV

# Every test on a fleet of each vLLM release the fake imitates (docs/decisions.md "vLLM releases").
fleet = release_fleet()

PRODUCERS = ["p0", "p1"]
CONSUMERS = ["d0", "d1"]


def one(fleet: FakeFleet, prompt: str, names: list[str]) -> tuple[str, dict]:
    """The single engine (and its single record) among ``names`` that saw ``prompt``."""
    found = records_anywhere(fleet, prompt, names)
    assert len(found) == 1, found
    name, recs = next(iter(found.items()))
    assert len(recs) == 1, recs
    return name, recs[0]


async def test_stream_completion_prefills_then_decodes_with_the_descriptor(
    router: RouterProcess, fleet: FakeFleet
) -> None:
    prompt = unique_prompt()
    reply = await send(router.url, "/v1/completions", completion(prompt, max_tokens=6),
                       headers={"x-request-id": "client-rid-1", "traceparent": "00-abc-def-01"})
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    assert reply.headers["x-request-id"] == "client-rid-1"
    assert reply.text == expected_text(6)
    assert reply.events[-1] == b"[DONE]"

    pname, prefill = one(fleet, prompt, PRODUCERS)
    dname, decode = one(fleet, prompt, CONSUMERS)
    assert prefill["phase"] == "prefill" and decode["phase"] == "decode"
    # The same fresh backend id on both legs, derived from the client's, never the client's itself.
    rid = prefill["headers"]["x-request-id"]
    assert rid == decode["headers"]["x-request-id"] != "client-rid-1"
    assert re.fullmatch(r"client-rid-1-[0-9a-f]{16}-a1", rid), rid
    assert prefill["headers"]["traceparent"] == decode["headers"]["traceparent"] == "00-abc-def-01"
    # The decode carries the producer's descriptor, opaque fields and all.
    producer_stats = fleet.stats(pname)
    kv = decode["body"]["kv_transfer_params"]
    assert kv["remote_engine_id"] == producer_stats["engine_id"]
    assert kv["remote_port"] == int(fleet.engines[pname].rsplit(":", 1)[1])
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    if producer_stats["version"] == "0.11.0":  # its seven keys (vLLM 0.33's sources), a flat block list
        assert sorted(kv) == sorted(("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                                     "remote_host", "remote_port", "tp_size"))
        assert all(type(b) is int for b in kv["remote_block_ids"])
    else:  # 0.33's, opaque ones and all, and one block list per KV cache group
        for opaque in ("tp_size", "dcp_size", "pp_size", "remote_num_tokens", "transfer_mode", "remote_request_id"):
            assert opaque in kv, opaque
        assert kv["remote_num_tokens"] == 12
        assert all(type(group) is list for group in kv["remote_block_ids"])
    # The decode body is the client's body plus the descriptor, nothing else changed.
    expected = completion(prompt, max_tokens=6)
    expected["kv_transfer_params"] = kv
    assert decode["body"] == expected


async def test_prefill_body_is_rewritten_exactly(router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    body = completion(
        prompt,
        max_tokens=5,
        max_completion_tokens=5,
        stream_options={"include_usage": True},
        min_tokens=2,
        stop=["\n"],
        stop_token_ids=[7],
        temperature=0.5,
        kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "evil", "remote_host": "10.9.9.9"},
    )
    reply = await send(router.url, "/v1/completions", body)
    assert reply.status == 200, reply.raw
    _, prefill = one(fleet, prompt, PRODUCERS)
    assert prefill["body"] == {
        "model": MODEL,
        "prompt": prompt,
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "temperature": 0.5,
        "ignore_eos": True,
        "kv_transfer_params": PREFILL_KV,
    }
    _, decode = one(fleet, prompt, CONSUMERS)
    sent = dict(body)
    del sent["kv_transfer_params"]
    kv = decode["body"].pop("kv_transfer_params")
    assert decode["body"] == sent  # stream, stop, stream_options… as the client sent them
    assert kv["remote_engine_id"] != "evil" and kv["remote_host"] == "127.0.0.1"


async def test_client_kv_transfer_params_never_reach_an_engine(router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    raw = (
        b'{"model": "fake-model", "kv_transfer_params": {"remote_host": "attacker"}, "prompt": "'
        + prompt.encode()
        + b'", "stream": false, "max_tokens": 2, "kv_transfer_params": {"remote_host": "attacker2"}}'
    )
    reply = await send(router.url, "/v1/completions", raw=raw)
    assert reply.status == 200, reply.raw
    for recs in records_anywhere(fleet, prompt, PRODUCERS + CONSUMERS).values():
        for rec in recs:
            assert b"attacker" not in orjson.dumps(rec["body"])


async def test_non_streaming_completion_and_chat(router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    reply = await send(router.url, "/v1/completions", completion(prompt, stream=False, max_tokens=3))
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected_text(3)

    prompt = unique_prompt()
    reply = await send(router.url, "/v1/chat/completions", chat(prompt, stream=False, max_tokens=3))
    assert reply.status == 200
    assert reply.json["choices"][0]["message"]["content"] == expected_text(3)
    _, decode = one(fleet, prompt, CONSUMERS)
    assert decode["body"]["stream"] is False and "kv_transfer_params" in decode["body"]


async def test_stream_chat_relays_role_chunk_tokens_and_usage(router: RouterProcess) -> None:
    prompt = unique_prompt()
    reply = await send(
        router.url,
        "/v1/chat/completions",
        chat(prompt, max_tokens=5, stream_options={"include_usage": True}),
    )
    assert reply.status == 200
    events = [e for e in reply.events if e != b"[DONE]"]
    first = orjson.loads(events[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert orjson.loads(events[-1])["usage"]["completion_tokens"] == 5
    assert reply.text == expected_text(5)
    assert reply.events[-1] == b"[DONE]"


async def test_same_worker_decode_sends_no_transfer_parameters(same_router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    reply = await send(same_router.url, "/v1/completions", completion(prompt, max_tokens=3))
    assert reply.status == 200
    assert reply.text == expected_text(3)
    recs = records(fleet, "b0", prompt)
    assert [r["phase"] for r in recs] == ["prefill", "decode"]
    prefill, decode = recs
    assert "kv_transfer_params" not in prefill["body"]
    assert prefill["body"]["max_tokens"] == 1 and prefill["body"]["stream"] is False
    assert "kv_transfer_params" not in decode["body"]
    assert fleet.stats("b0")["held_blocks"] == 0


@pytest.mark.parametrize(
    ("fault", "detail"),
    [
        ("null", "invalid handoff: missing engine identity"),
        ("missing", "invalid handoff: missing engine identity"),
        ("no_engine_id", "invalid handoff: missing engine identity"),
        ("bad_blocks", "invalid handoff: malformed block IDs"),
        ("mooncake", "invalid handoff: connector mismatch"),
        ("lmcache", "invalid handoff: connector mismatch"),
        ("bad_port", "invalid handoff: malformed field remote_port"),
    ],
)
async def test_invalid_descriptor_is_a_502_and_is_sent_nowhere(
    router: RouterProcess, fleet: FakeFleet, fault: str, detail: str
) -> None:
    prompt = unique_prompt()
    reply = await send(router.url, "/v1/completions", completion(prompt, fake={"prefill": {"descriptor": fault}}))
    assert reply.status == 502
    assert reply.headers["x-narwhal-error"] == "invalid_handoff"
    assert error_of(reply) == {"message": detail, "type": "invalid_handoff", "param": None, "code": 502}
    assert records_anywhere(fleet, prompt, CONSUMERS) == {}


async def test_client_gone_during_prefill_releases_the_handoff(solo_router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    before = fleet.stats("p2")["expired_blocks"]
    body = completion(prompt, fake={"prefill": {"delay_headers_s": 0.4}})
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            async with asyncio.timeout(0.15):
                await session.post(solo_router.url + "/v1/completions", json=body)
    # The prefill still finishes; its handoff goes to d2 as a release, never as a stream.
    wait_until(lambda: len(records(fleet, "d2", prompt)) == 1, 5, "release decode on d2")
    rec = records(fleet, "d2", prompt)[0]
    assert rec["body"]["stream"] is False and rec["body"]["max_tokens"] == 1
    wait_until(lambda: fleet.stats("p2")["held_blocks"] == 0, 5, "p2 blocks freed")
    assert fleet.stats("p2")["expired_blocks"] == before


async def test_client_gone_during_prefill_with_a_malformed_descriptor_sends_it_nowhere(
    solo_router: RouterProcess, fleet: FakeFleet
) -> None:
    # The handoff of an abandoned prefill is validated like any other before it
    # goes to a consumer (a malformed one could crash a vLLM EngineCore): sent nowhere, abandoned.
    prompt = unique_prompt()
    counters = ("narwhal_handoffs_released_total", "narwhal_handoffs_abandoned_total")
    before = at_rest(solo_router, *counters)
    body = completion(prompt, fake={"prefill": {"delay_headers_s": 0.4, "descriptor": "bad_blocks"}})
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            async with asyncio.timeout(0.15):
                await session.post(solo_router.url + "/v1/completions", json=body)

    def deltas() -> tuple[float, ...]:
        now = scrape(solo_router)
        return tuple(value(now, name) - value(before, name) for name in counters)

    wait_until(lambda: deltas() == (0.0, 1.0), 5, "the abandoned handoff counted")
    assert records(fleet, "p2", prompt)[0]["outcome"] == "completed"  # the prefill did finish
    assert records(fleet, "d2", prompt) == []
    after = at_rest(solo_router, *counters)
    assert tuple(value(after, name) - value(before, name) for name in counters) == (0.0, 1.0)
    assert records(fleet, "d2", prompt) == []


async def test_client_disconnect_mid_stream_aborts_the_engine_request(router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    before = {n: fleet.stats(n)["aborted_streams"] for n in CONSUMERS}
    body = completion(prompt, max_tokens=200, fake={"decode": {"token_delay_s": 0.05}})
    async with aiohttp.ClientSession() as session:
        resp = await session.post(router.url + "/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readany()  # the stream is flowing
        resp.close()  # the client goes away
    wait_until(
        lambda: sum(fleet.stats(n)["aborted_streams"] - before[n] for n in CONSUMERS) == 1,
        10,
        "the consumer saw its stream aborted",
    )
    dname, _ = one(fleet, prompt, CONSUMERS)
    wait_until(lambda: fleet.stats(dname)["active_streams"] == 0, 5, "no stream left open on the consumer")


same_aged = router_fixture(
    engines_named("b0"), "b0 alone, role both, a handoff age far below any prefill: same-worker decodes only.",
    handoff={"max_age_s": 0.001},
)


async def test_a_same_worker_decode_has_no_age_limit_and_counts_nothing(
    same_aged: RouterProcess, fleet: FakeFleet
) -> None:
    # No handoff, no lease: only the request's deadline bounds it (docs/behaviour.md, "Handoff rules").
    before = at_rest(same_aged, "narwhal_handoffs_abandoned_total")
    reply = await send(same_aged.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
    assert reply.status == 200, reply.raw
    after = at_rest(same_aged, "narwhal_handoffs_abandoned_total")
    assert value(after, "narwhal_handoffs_abandoned_total") == value(before, "narwhal_handoffs_abandoned_total")


@pytest.mark.parametrize("which", ["router", "same_router"])
async def test_a_client_handoff_in_generate_sampling_params_never_reaches_an_engine(
    which: str, request: pytest.FixtureRequest, fleet: FakeFleet
) -> None:
    # vLLM's generate route reads sampling_params.extra_args.kv_transfer_params when the top-level
    # key is absent, as on a same-worker decode: a client's would name the host KV is read from.
    target: RouterProcess = request.getfixturevalue(which)
    tag = unique_prompt()
    body = {"model": "fake-model", "token_ids": [11, 12, 13], "stream": False, "cache_salt": tag,
            "sampling_params": {"max_tokens": 2, "extra_args": {"kv_transfer_params": {"remote_host": "attacker"},
                                                                "keep": 1}}}
    reply = await send(target.url, "/inference/v1/generate", body)
    recs = [r for recs in records_anywhere(fleet, tag, [*PRODUCERS, *CONSUMERS, "b0"]).values() for r in recs]
    if fleet.version == "0.11.0":  # no generate route on 0.11: 501, and no engine asked at all
        assert (reply.status, recs) == (501, []), reply.raw
        return
    assert reply.status == 200, reply.raw
    assert recs and all(b"attacker" not in orjson.dumps(r["body"]) for r in recs)
    assert all(r["body"]["sampling_params"]["extra_args"] == {"keep": 1} for r in recs if r["phase"] == "decode")


@pytest.mark.parametrize(("which", "path"), [("router", "/v1/chat/completions"), ("router", "/tokenize"),
                                             ("same_router", "/v1/completions")])
async def test_a_client_handoff_in_vllm_xargs_never_reaches_an_engine(
    which: str, path: str, request: pytest.FixtureRequest, fleet: FakeFleet
) -> None:
    """vLLM builds the sampling ``extra_args`` from ``vllm_xargs`` and keeps its
    ``kv_transfer_params`` when the body has none (a real 0.32 producer answers 500 to ``"x"``):
    stripped on every route and leg, the client's other extra args kept."""
    target: RouterProcess = request.getfixturevalue(which)
    prompt = unique_prompt()
    xargs = {"vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}
    if path == "/tokenize":
        body: dict = {"model": "fake-model", "prompt": prompt, **xargs}
    elif path == "/v1/completions":
        body = completion(prompt, max_tokens=2, **xargs)
    else:
        body = chat(prompt, max_tokens=2, **xargs)
    reply = await send(target.url, path, body)
    assert reply.status == 200, reply.raw
    recs = [r for recs in records_anywhere(fleet, prompt, [*PRODUCERS, *CONSUMERS, "b0"]).values() for r in recs]
    assert recs and all(r["body"]["vllm_xargs"] == {"keep": 1} for r in recs)


async def test_a_limit_above_the_models_context_is_refused_before_any_prefill(
    router: RouterProcess, fleet: FakeFleet
) -> None:
    """The fleet's engines report ``max_model_len`` 1048576 in ``/v1/models``: a stream asking for
    more is refused at admission with vLLM's message, and no engine is asked (no handoff exists)."""
    prompt = unique_prompt()
    reply = await send(router.url, "/v1/completions", completion(prompt, max_tokens=1048577))
    assert reply.status == 400
    error = reply.json["error"]
    assert error["message"] == ("max_tokens=1048577 cannot be greater than max_model_len=1048576. Please request "
                                "fewer output tokens. (parameter=max_tokens, value=1048577)")
    assert error["param"] == "max_tokens"
    assert records_anywhere(fleet, prompt, [*PRODUCERS, *CONSUMERS, "b0"]) == {}
