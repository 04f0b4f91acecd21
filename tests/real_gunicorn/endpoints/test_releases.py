"""vLLM's releases (docs/behaviour.md) through real gunicorn on a fleet of each the fake imitates (0.11.0,
0.21.0 and 0.33.0): every P/D endpoint's happy path with the descriptor passed through byte for byte, a
consumer's refusal released exactly when that release leaves the blocks pinned, and (0.33) the
holdings learning from ``remote_prefill_cached_tokens`` with the usage details off. One fixture,
parametrized over the releases: the tests are written once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from openai import AsyncOpenAI

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.endpoints_support import ALL, Endpoint
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    Reply,
    access_line,
    admin,
    at_rest,
    chat,
    completion,
    records,
    send,
    start_router,
    unique_prompt,
    value,
    wait_until,
)

RELEASES = ["0.11.0", "0.21.0", "0.33.0"]
COUNTERS = ("narwhal_handoffs_released_total", "narwhal_handoffs_abandoned_total")
# The producer's descriptor keys of each release (vLLM's NixlConnector, `nixl_connector.py`, in each release;
# docs/decisions.md "vLLM releases").
KEYS_0_11 = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_host",
             "remote_port", "tp_size"]
KEYS_0_21 = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
             "remote_host", "remote_port", "tp_size", "remote_num_tokens"]
KEYS_0_33 = KEYS_0_11 + ["remote_request_id", "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time",
                         "remote_registration_generation", "transfer_mode", "remote_prefill_cached_tokens"]


@pytest.fixture(scope="module", params=RELEASES)
def release(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[str, FakeFleet, RouterProcess]]:
    version = request.param
    fleet = FakeFleet.start(["vp0", "vd0"], args=["--vllm-version", version, "--model", MODEL, "--lease-s", "60",
                                                  "--block-size", "4", "--enable-scale-out", "--prefix-cache"])
    try:
        engines = [{"name": "vp0", "role": "producer"}, {"name": "vd0", "role": "consumer"}]
        router = start_router(fleet, engines, tmp_path_factory.mktemp(f"v{version}"),
                              server={"workers": 2, "admin_token": TOKEN})
        try:
            yield version, fleet, router
        finally:
            router.stop()
    finally:
        fleet.stop()


def _bodies(tag: str) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("/v1/completions", completion(tag)), ("/v1/chat/completions", chat(tag))]
    out += [(e.path, Endpoint.body(e, tag)) for e in ALL]
    return out


# What 0.11 cannot hand off on (docs/behaviour.md, "Endpoints per release").
NO_ROUTE_0_11 = ("/v1/messages", "/inference/v1/generate")  # no such route: 501
ALONE_0_11 = ("/v1/responses",)  # the route, but no handoff: served by the consumer alone


async def test_every_endpoint_decodes_the_producers_descriptor_unchanged(
    release: tuple[str, FakeFleet, RouterProcess]
) -> None:
    version, fleet, router = release
    handed = 0
    for path, body in _bodies(tag := unique_prompt()):
        reply = await send(router.url, path, body)
        if version == "0.11.0" and path in NO_ROUTE_0_11:
            assert (reply.status, reply.headers["x-narwhal-error"]) == (501, "not_implemented"), reply.raw
            continue
        assert reply.status == 200, (version, path, reply.raw)
        if version == "0.11.0" and path in ALONE_0_11:
            continue
        handed += 1
    if version == "0.11.0":  # nothing reached the producer for what 0.11 cannot hand off
        paths = [r["path"] for r in records(fleet, "vp0", tag)]
        assert not set(paths) & {*NO_ROUTE_0_11, *ALONE_0_11}, paths
    # Every decode carried exactly what its prefill answered (docs/behaviour.md "Handoff validation": opaque keys
    # kept).
    decodes = [r for r in fleet.control_request("GET", "/engines/vd0/requests")["requests"]
               if r["body"].get("kv_transfer_params", {}).get("do_remote_prefill")]
    assert len(decodes) >= handed
    for rec in decodes[-handed:]:
        desc = rec["body"]["kv_transfer_params"]
        blocks = desc["remote_block_ids"]
        if version == "0.11.0":
            assert "remote_request_id" not in desc and all(type(b) is int for b in blocks)
        elif version == "0.21.0":  # nine keys: no transfer mode, no cached-token count
            assert len(desc) == 9 and "transfer_mode" not in desc and all(type(g) is list for g in blocks)
        else:
            assert desc["transfer_mode"] == "pull" and "remote_prefill_cached_tokens" in desc
            assert all(type(group) is list for group in blocks)
    wait_until(lambda: fleet.stats("vp0")["held_blocks"] == 0, 10, "every handoff read")
    assert fleet.stats("vd0")["incompatible_decodes"] == 0 and fleet.stats("vp0")["expired_reads"] == 0


async def _refused(router: RouterProcess, fleet: FakeFleet, path: str, body: dict[str, Any],
                   status: int) -> tuple[Reply, float]:
    """Send ``body``, which the consumer refuses with ``status``; once the producer holds nothing,
    the reply and how many releases the router made for it."""
    before = value(at_rest(router, *COUNTERS), COUNTERS[0])
    reply = await send(router.url, path, body)
    assert reply.status == status, reply.raw
    wait_until(lambda: fleet.stats("vp0")["held_requests"] == 0, 10, "the refused handoff freed")
    return reply, value(at_rest(router, *COUNTERS), COUNTERS[0]) - before


async def test_a_consumers_refusal_is_released_only_where_vllm_leaves_the_blocks_pinned(
    release: tuple[str, FakeFleet, RouterProcess]
) -> None:
    version, fleet, router = release
    # A prompt near the 8192-token context (the fake counts words) and a limit past what is left:
    # the prefill (one token) fits; 0.11 refuses the decode, 0.12 on clamps its limit.
    prompt = unique_prompt(8000)
    body = completion(prompt, max_tokens=500, stream=False)
    if version != "0.11.0":
        reply = await send(router.url, "/v1/completions", body)
        assert reply.status == 200 and reply.json["usage"]["completion_tokens"] == 192, reply.raw[:300]
        return
    reply, released = await _refused(router, fleet, "/v1/completions", body, 400)
    decodes = records(fleet, "vd0", prompt)
    # no cleanup in vLLM before 0.21.0: Narwhal's release frees them
    assert released == 1.0 and len(decodes) == 2
    assert (decodes[1]["body"]["stream"], decodes[1]["body"]["max_tokens"]) == (False, 1)


async def test_a_limit_past_the_context_is_refused_before_any_prefill_on_every_release(
    release: tuple[str, FakeFleet, RouterProcess]
) -> None:
    """The consumer would refuse it only after a handoff exists: the router refuses it first,
    with vLLM's message, from the ``max_model_len`` the engines' ``/v1/models`` report."""
    _, fleet, router = release
    prompt = unique_prompt()
    reply = await send(router.url, "/v1/completions", completion(prompt, max_tokens=9000))
    assert reply.status == 400 and reply.json["error"]["param"] == "max_tokens"
    assert "cannot be greater than max_model_len=8192" in reply.json["error"]["message"]
    assert records(fleet, "vp0", prompt) == records(fleet, "vd0", prompt) == []


async def test_a_validation_refusal_by_the_consumer_is_released_on_every_release(
    release: tuple[str, FakeFleet, RouterProcess]
) -> None:
    # vLLM's request validation answers before any handler: no release of vLLM's frees the
    # handoff then, so Narwhal releases it (docs/behaviour.md, "A consumer's refusal").
    version, fleet, router = release
    prompt = unique_prompt()
    fault = {"decode": {"status": 400, "validation": True, "message": "Value error, bad field", "streams_only": True}}
    reply, released = await _refused(router, fleet, "/v1/completions", completion(prompt, fake=fault), 400)
    assert reply.json["error"]["param"] == "body.fake_field"  # the engine's param, kept for the client
    assert released == 1.0 and len(records(fleet, "vd0", prompt)) == 2, version
    assert fleet.stats("vp0")["expired_reads"] == 0


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"stop": 5}, "stop"),
    ("/v1/messages", {"max_tokens": 0}, None),
])
async def test_what_only_the_consumer_would_validate_is_refused_before_any_prefill(
    release: tuple[str, FakeFleet, RouterProcess], path: str, extra: dict[str, Any], param: str | None
) -> None:
    # The prefill drops (or overrides) these fields, so the producer would accept the request and
    # the consumer refuse it with a validation 400 that frees nothing: refused at admission.
    version, fleet, router = release
    tag = unique_prompt()
    if path == "/v1/messages":
        body = Endpoint.body(next(e for e in ALL if e.path == path), tag, **extra)
    else:
        body = (completion if path == "/v1/completions" else chat)(tag, **extra)
    reply = await send(router.url, path, body)
    assert reply.status == 400, reply.raw
    if param is None:  # Anthropic's shape
        assert reply.json == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": "max_tokens must be positive"}}
    else:
        assert reply.json["error"]["param"] == param
    assert records(fleet, "vp0", tag) == [] and records(fleet, "vd0", tag) == [], version


@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": 5}, "sampling_params.stop"),
    ({"stop_token_ids": ["a"]}, "sampling_params.stop_token_ids"),
    ({"min_tokens": 9}, "sampling_params.min_tokens"),
])
async def test_generates_nested_fields_only_the_consumer_would_validate_are_refused_before_any_prefill(
    release: tuple[str, FakeFleet, RouterProcess], extra: dict[str, Any], param: str
) -> None:
    version, fleet, router = release
    tag = unique_prompt()
    body = {"model": MODEL, "token_ids": [5, 6, 7], "cache_salt": tag, "sampling_params": {"max_tokens": 4, **extra}}
    reply = await send(router.url, "/inference/v1/generate", body)
    assert reply.status == 400 and reply.json["error"]["param"] == param, reply.raw
    assert records(fleet, "vp0", tag) == [] and records(fleet, "vd0", tag) == [], version


async def test_a_refusal_on_generate_is_released(release: tuple[str, FakeFleet, RouterProcess]) -> None:
    version, fleet, router = release
    if version == "0.11.0":
        pytest.skip("0.11.0 has no /inference/v1/generate route")
    body = Endpoint.body(next(e for e in ALL if e.path == "/inference/v1/generate"), unique_prompt())
    body["narwhal_fake"] = {"decode": {"status": 422, "message": "refused", "streams_only": True}}
    _, released = await _refused(router, fleet, "/inference/v1/generate", body, 422)
    assert released == 1.0  # vLLM does not wrap generate's handler: nothing freed it but Narwhal
    assert fleet.stats("vp0")["expired_reads"] == 0


async def test_the_admin_api_shows_each_engines_version_and_transfer_mode(
    release: tuple[str, FakeFleet, RouterProcess]
) -> None:
    version, _, router = release
    engines = {e["name"]: e for e in (await admin(router))["engines"]}
    assert {n: (e["version"], e["transfer_mode"]) for n, e in engines.items()} == {
        "vp0": (version, "pull"), "vd0": (version, "pull")}
    metrics = at_rest(router, "narwhal_engine_info")
    assert value(metrics, "narwhal_engine_info", engine="vp0", role="producer", version=version) == 1.0


@pytest.mark.parametrize("path", ["chat", "completions"])
async def test_continuous_usage_reaches_the_client_on_every_chunk(
    release: tuple[str, FakeFleet, RouterProcess], path: str
) -> None:
    """guidellm and aiperf's ``--per-chunk-usage`` ask for ``continuous_usage_stats``: the running
    usage the consumer writes on every chunk reaches the client's SDK, and the access log counts
    the last one (docs/behaviour.md "Decode", its relay; vLLM's chunk shapes of each release)."""
    version, _, router = release
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    rid = f"cont-{path}-{version}-{unique_prompt(2).replace(' ', '-')}"
    async with AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=20) as sdk:
        if path == "chat":
            stream: Any = await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": unique_prompt()}], stream=True, max_tokens=3,
                stream_options=options, extra_headers={"X-Request-Id": rid})
        else:
            stream = await sdk.completions.create(model=MODEL, prompt=unique_prompt(), stream=True, max_tokens=3,
                                                  stream_options=options, extra_headers={"X-Request-Id": rid})
        chunks = [c async for c in stream]
    running = [c.usage.completion_tokens for c in chunks if c.choices]
    assert running == ([0, 1, 2, 3] if path == "chat" else [1, 2, 3]), (version, running)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert access_line(router, rid)["completion_tokens"] == 3


async def _entry_when(router: RouterProcess, name: str, predicate: Any, what: str, timeout: float = 15) -> dict:
    """``name``'s ``/admin/engines`` entry once ``predicate`` holds for it (bounded wait)."""
    end = time.monotonic() + timeout
    while True:
        entry = {e["name"]: e for e in (await admin(router))["engines"]}[name]
        if predicate(entry):
            return entry
        assert time.monotonic() < end, f"{name}: {what}: {entry}"
        await asyncio.sleep(0.05)


async def test_admin_engines_names_an_engine_refusing_generate(release: tuple[str, FakeFleet, RouterProcess]) -> None:
    """docs/decisions.md "vLLM releases": a consumer restarted without ``--enable-scale-out`` answers 403 on
    ``/inference/v1/generate`` on 0.33 (0.11 serves it regardless): ``/admin/engines`` says so in
    preflight's line once the supervisor has read the new process, and forgets it once the
    engine is restarted with the flag."""
    version, fleet, router = release
    entry = await _entry_when(router, "vd0", lambda e: e["version"] == version, "its version read")
    assert entry["refused_endpoints"] == {}
    try:
        fleet.control_request("POST", "/engines/vd0/stop")
        await _entry_when(router, "vd0", lambda e: e["unreachable"], "seen refusing connections")
        fleet.control_request("POST", "/engines/vd0/start?restart=1&scale_out=0")
        if version in ("0.11.0", "0.21.0"):  # generate needs no flag there
            entry = await _entry_when(router, "vd0", lambda e: not e["unreachable"], "reachable again")
            assert entry["refused_endpoints"] == {}
        else:
            refusal = "answers 403 on /inference/v1/generate: vLLM runs without --enable-scale-out"
            await _entry_when(router, "vd0", lambda e: e["refused_endpoints"] == {"/inference/v1/generate": refusal},
                              "named as refusing generate")
    finally:
        fleet.control_request("POST", "/engines/vd0/stop")
        await _entry_when(router, "vd0", lambda e: e["unreachable"], "seen refusing connections")
        fleet.control_request("POST", "/engines/vd0/start?restart=1&scale_out=1")
    await _entry_when(router, "vd0", lambda e: not e["unreachable"] and e["refused_endpoints"] == {},
                      "serving generate again")
    if version == "0.33.0":  # the supervisor's one line, once per change
        assert router.log_text().count("engine vd0 answers 403 on /inference/v1/generate") == 1


@pytest.mark.parametrize("shape", [None, "empty_groups", "hybrid_groups"])
async def test_the_consumer_gets_the_producers_descriptor_byte_for_byte(
    release: tuple[str, FakeFleet, RouterProcess], shape: str | None
) -> None:
    """docs/decisions.md "vLLM releases": every key of the release's descriptor, in the producer's order, and 0.33's
    block
    ids of every valid shape (``[[3, 4]]``, ``[[]]``, ``[[], [3, 4]]``; 0.11: a flat list) reach
    the consumer as the producer wrote them; then the blocks are freed."""
    version, fleet, router = release
    prompt = unique_prompt()
    fake = {"prefill": {"descriptor": shape}} if shape else None
    reply = await send(router.url, "/v1/completions", completion(prompt, max_tokens=3, fake=fake))
    assert reply.status == 200, reply.raw
    [prefill] = records(fleet, "vp0", prompt)
    [decode] = records(fleet, "vd0", prompt)
    answered = prefill["answer_kv"]
    assert orjson.dumps(decode["body"]["kv_transfer_params"]) == orjson.dumps(answered)
    blocks = answered["remote_block_ids"]
    if version == "0.11.0":
        assert list(answered) == KEYS_0_11 and all(type(b) is int for b in blocks)
    else:
        assert list(answered) == KEYS_0_21 if version == "0.21.0" else sorted(answered) == sorted(KEYS_0_33)
        expected_shape = {None: [blocks[-1]], "empty_groups": [[]], "hybrid_groups": [[], blocks[-1]]}[shape]
        assert blocks == expected_shape and (shape == "empty_groups" or blocks[-1])
    wait_until(lambda: fleet.stats("vp0")["held_blocks"] == 0, 10, "the handoff read")
