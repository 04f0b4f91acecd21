"""An engine that answers garbage, through real gunicorn (nothing an engine sends
may raise in a loop).

``hx`` is a stand-in for a broken or malicious engine on 127.0.0.1: every answer, on every route
the router and its supervisor use (``/health``, ``/version``, ``/v1/models``, ``/metrics``, the
inference routes, both legs, streaming and not), is drawn from a seeded stream of hostile bodies:
out-of-range and huge numbers, wrong types, deep nesting, invalid UTF-8, capacity labels of 2^70,
negative cached tokens, SSE without a blank line, half events, ``[DONE]`` first. It serves as
both producer and consumer beside a healthy pair (``gp0`` → ``gd0``, a fleet of their own with a
short lease: a handoff ``hx`` took for decoding and never read is freed by it, as vLLM's would be).

The property, over a bounded load: every answer is a 200, an engine's own 4xx passed on (docs/behaviour.md
"Failure semantics"), an engine's own 5xx code from an error inside its 200 stream (``engine_stream_error``:
``hx``'s garbage descriptor makes ``gd0``'s pull fail, and vLLM reports that as code 500), or one of the
5xx docs/behaviour.md "Failure semantics" maps an engine fault to (never a 500 the router made);
``/metrics`` answers 200 every time it is scraped; no process is replaced (the supervisor and the workers keep
their pids); no traceback is logged; and once ``hx``'s breaker has taken it out, every request
is served by the healthy pair.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    completion,
    engine_entry,
    scrape,
    send,
    start_router,
    unique_prompt,
    wait_until,
)
from tests.threaded_app import ThreadedApp

SEED = 40_12
LEASE_S = 3  # the healthy producer's lease: what a garbage consumer never read is freed by it
REQUESTS = 120
CONCURRENCY = 4
ENGINE_FAULT_STATUSES = {502, 503, 504}  # docs/behaviour.md "Failure semantics"'s mapping of an engine's failure


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, nasty on purpose: huge and negative integers, odd floats, long strings."""
    kind = rng.randrange(9 if depth < 6 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**31, 2**32, 2**63, 2**64 + 5, -(2**70), 10**40])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e308, 3.0e-320])
    if kind == 4:
        return rng.choice(["", "x" * 10_000, "0.33.0", "\u0000\ud7ff", "NaN", "-1", "99999999999999999999"])
    if kind == 5:
        return rng.choice([[], {}, [[]], [[], [1]], {"": None}])
    if kind == 6:
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["usage", "choices", "kv_transfer_params", "data", "version", "error", "id", "x"]):
            _json_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _dumps(value: Any) -> bytes:
    """JSON as an engine might send it: integers of any size (orjson stops at 64 bits)."""
    return json.dumps(value).encode()


def _descriptor(rng: random.Random) -> Any:
    """A descriptor that looks almost right: every key vLLM sends, each value possibly wrong."""
    good: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
                            "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "127.0.0.1",
                            "remote_port": 1, "tp_size": 1, "remote_prefill_cached_tokens": 0,
                            "remote_num_tokens": 3}
    for key in rng.sample(sorted(good), rng.randrange(1, 4)):
        good[key] = _json_value(rng)
    return good if rng.random() < 0.9 else _json_value(rng)


def _whole(rng: random.Random) -> bytes:
    """A non-streaming answer (a prefill's, or a decode's without ``stream``)."""
    usage = {"prompt_tokens": _json_value(rng), "completion_tokens": rng.choice([-5, 7, "7", 2**64]),
             "prompt_tokens_details": rng.choice([None, {"cached_tokens": -3}, {"cached_tokens": 2**70}, []])}
    body = {"id": "cmpl-x", "object": "text_completion", "model": MODEL,
            "choices": rng.choice([[], [{"index": 0, "text": " t0", "finish_reason": "length"}], "x"]),
            "usage": usage, "kv_transfer_params": _descriptor(rng)}
    choice = rng.randrange(5)
    if choice == 0:
        return _dumps(_json_value(rng))
    if choice == 1:
        return b'{"completion_tokens": ' + b"9" * 5000 + b"}"  # thousands of digits
    if choice == 2:
        return b"\xff\xfe not utf-8 \x80"
    return _dumps(body)


def _stream(rng: random.Random) -> list[bytes]:
    """A decode's SSE, broken in one of many ways."""
    frames = [
        [b'data: {"choices":[{"index":0,"text":" t0"}]}\n\n', b"data: [DONE]\n\n"],
        [b"data: [DONE]\n\n"],  # done before any token
        [b"data: " + b"x" * 70_000],  # no blank line ever, a long line
        [b'data: {"choices":[{"index":0,"text":" t0"}]}\n\n', b'data: {"usage":{"completion_tokens":-5}}\n\n',
         b"data: [DONE]\n\n"],
        [b"data: {not json}\n\n", b"data: [DONE]\n\n"],
        [b'data: {"error": ' + _dumps(_json_value(rng)) + b"}\n\n", b"data: [DONE]\n\n"],
        [b'event: x\ndata: {"choices":' + _dumps(_json_value(rng)) + b"}\n\n"],
        [b"\xff\xfe\n\n", b"data: [DONE]\n\n"],
    ]
    return rng.choice(frames)


def _metrics(rng: random.Random) -> bytes:
    lines = [
        b'vllm:num_requests_running{engine="0"} ' + rng.choice([b"-1", b"1e400", b"NaN", b"x", b"9" * 20]),
        b"vllm:num_requests_waiting " + rng.choice([b"-7", b"inf", b"2"]),
        b"vllm:kv_cache_usage_perc " + rng.choice([b"-0.5", b"7", b"nan"]),
        b'vllm:cache_config_info{block_size="' + rng.choice([b"16", b"0", b"-3", b"None", b"1" * 30])
        + b'",num_gpu_blocks="' + rng.choice([b"4294967296", b"18446744073709551617", b"-1", b"abc"])
        + b'",kv_cache_size_tokens="' + rng.choice([b"None", b"1" * 40, b"-9", b"12"]) + b'"} 1',
        b"vllm:request_prefill_time_seconds_sum " + rng.choice([b"-1", b"1e308", b"x"]),
        b"vllm:request_prefill_time_seconds_count " + rng.choice([b"-1", b"0", b"3"]),
        b"vllm:prefix_cache_hits_total " + rng.choice([b"-10", b"1e30"]),
    ]
    rng.shuffle(lines)
    return b"\n".join(lines) + rng.choice([b"\n", b"", b"\n\xff"])


class HostileEngine(ThreadedApp):
    """The garbage engine."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.answers = {"GET": 0, "POST": 0}  # control reads, inference requests
        super().__init__()

    def build(self) -> web.Application:
        """Every path, every method: :meth:`_answer`."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._answer)
        return app

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.answers[request.method] = self.answers.get(request.method, 0) + 1
        rng = self.rng
        path = request.path
        if path == "/health":
            return web.Response(status=rng.choice([200, 200, 503]))
        if path == "/metrics":
            return web.Response(body=_metrics(rng), content_type="text/plain")
        if path in ("/version", "/v1/models", "/load"):
            return web.Response(body=_dumps(_json_value(rng)) if rng.random() < 0.8 else b"\xff{",
                                content_type="application/json")
        try:
            body = await request.json()
        except ValueError:
            body = {}
        if isinstance(body, dict) and body.get("stream") is True:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for frame in _stream(rng):
                await resp.write(frame)
            return resp
        status = rng.choice([200, 200, 200, 400, 500, 200])
        return web.Response(status=status, body=_whole(rng), content_type="application/json")


@pytest.fixture(scope="module")
def hostile_engine() -> Iterator[HostileEngine]:
    engine = HostileEngine(SEED)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def healthy() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(["gp0", "gd0"], args=["--model", MODEL, "--block-size", "4", "--lease-s", str(LEASE_S)])
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def garbage_router(healthy: FakeFleet, hostile_engine: HostileEngine,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines: list[dict[str, Any]] = [
        {"name": "gp0", "role": "producer"}, {"name": "gd0", "role": "consumer"},
        # Its models configured: its /v1/models answers are garbage, and placement must still try it.
        {"name": "hx", "role": "both", "url": hostile_engine.url, "models": [MODEL]},
    ]
    router = start_router(healthy, engines, tmp_path_factory.mktemp("garbage"),
                          server={"workers": 2, "admin_token": TOKEN}, handoff={"max_age_s": 2.8, "lease_s": LEASE_S},
                          placement={"load_interval_s": 0.05},
                          recovery={"eject_after": 5, "max_retries": 1, "health_interval_s": 0.2,
                                    "max_ejected_fraction": 1.0, "readmit_interval_s": 60},
                          log={"level": "info"})
    yield router
    router.stop()


async def test_an_engine_answering_garbage_stops_no_loop_and_the_others_serve(
    garbage_router: RouterProcess, hostile_engine: HostileEngine, healthy: FakeFleet
) -> None:
    router = garbage_router
    master = router.proc.pid
    before = router_roles(master)
    # The supervisor's reads of hx (health, version, the generate question, /metrics) first: garbage
    # read off its loop before any request, then throughout the load.
    wait_until(lambda: hostile_engine.answers["GET"] >= 10, 15, "the supervisor reading hx")
    statuses: list[tuple[int, str]] = []
    scrapes: list[int] = []
    sent = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while sent < REQUESTS:
            sent += 1
            stream = sent % 2 == 0
            async with session.post(router.url + "/v1/completions",
                                    json=completion(unique_prompt(), stream=stream, max_tokens=3)) as resp:
                await resp.read()
                statuses.append((resp.status, resp.headers.get("x-narwhal-error", "")))

    async def scraper(session: aiohttp.ClientSession) -> None:
        while sent < REQUESTS:
            async with session.get(router.url + "/metrics") as resp:
                await resp.read()
                scrapes.append(resp.status)
            await asyncio.sleep(0.05)

    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.wait_for(asyncio.gather(scraper(session), *(client(session) for _ in range(CONCURRENCY))), 120)
    # hx answers some requests well enough (a valid stream now and then), which ends its failure
    # streak: go on, bounded, until its breaker has taken it out, holding the property throughout.
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(300):
            if (await engine_entry(router, "hx"))["state"] in ("ejected", "probing"):
                break
            async with session.post(router.url + "/v1/completions",
                                    json=completion(unique_prompt(), max_tokens=3)) as resp:
                await resp.read()
                statuses.append((resp.status, resp.headers.get("x-narwhal-error", "")))
    assert (await engine_entry(router, "hx"))["state"] in ("ejected", "probing")
    # The garbage was really read on the request path too.
    assert hostile_engine.answers["POST"] >= 5, hostile_engine.answers
    for status, kind in statuses:
        assert (status in {200} | ENGINE_FAULT_STATUSES
                or (400 <= status < 500 and kind == "engine_client_error")
                or (500 <= status < 600 and kind == "engine_stream_error")), (status, kind)
    assert scrapes and set(scrapes) == {200}
    # Once hx is out, the healthy pair serves everything.
    for _ in range(20):
        reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=3))
        assert reply.status == 200, reply.raw
    after = router_roles(master)
    assert after["supervisor"] == before["supervisor"] and sorted(after["worker"]) == sorted(before["worker"])
    log = router.log_text()
    assert "Traceback" not in log, log[log.find("Traceback") - 2000: log.find("Traceback") + 3000]
    assert "narwhal_requests_total" in scrape(router)
    wait_until(lambda: healthy.stats("gp0")["held_blocks"] == 0, LEASE_S + 5, "gp0's handoffs freed")
