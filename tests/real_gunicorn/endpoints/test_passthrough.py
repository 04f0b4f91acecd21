"""The passthrough routes (docs/behaviour.md "The request path", "The other P/D endpoints") through real gunicorn: one
engine, no P/D.

Two routers. ``router``: p0 → d0, d1, client keys, an engine key, a small body limit and a long
first-token bound (so a deliberately slow request is slow, not failed). ``solo``: p1 → d2, both
configured with a second model (two served models), breakers that eject after 3 counted
failures and never readmit by themselves (no health checks or readmission within a test), so
each breaker test sees exactly its own failures.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson

from narwhal.fake_engine.passthrough import token_ids
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.endpoints_support import PASSTHROUGH_ROUTES, body_for
from tests.real_gunicorn.fixtures import engines_named, faults_cleared_after_each, release_fleet, router_fixture
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    access_line,
    admin,
    at_rest,
    engine_entry,
    error_of,
    records,
    scrape,
    send,
    unique_prompt,
    wait_state,
    wait_until,
)

# Every test on a fleet of each vLLM release the fake imitates (docs/decisions.md "vLLM releases").
fleet = release_fleet()

KEY = {"Authorization": "Bearer client-key"}
ENGINE_KEY = "engine-key"
MAIN = ["p0", "d0", "d1"]
SOLO = ["p1", "d2"]
CLIENT_KV = {"do_remote_prefill": True, "remote_engine_id": "smuggled", "remote_block_ids": [1]}
PASSTHROUGH_RECOVERY = {"eject_after": 3, "readmit_interval_s": 60, "readmit_interval_max_s": 60,
                        "health_interval_s": 60}


router = router_fixture(
    engines_named("p0", "d0", "d1"), "p0 → d0, d1 with client keys, an engine key and a small body bound.",
    server={"workers": 2, "admin_token": TOKEN, "api_keys": ["client-key"], "max_body_bytes": 65536},
    engine={"first_token_timeout_s": 10, "api_key": ENGINE_KEY},
    recovery={"readmit_interval_s": 60, "readmit_interval_max_s": 60, "health_interval_s": 60},
)


solo = router_fixture(
    engines_named("p1", "d2", models=[MODEL, "second-model"]),  # configured: the fakes answer for MODEL only
    "p1 → d2, each configured with two models.",
    server={"workers": 2, "admin_token": TOKEN}, recovery=PASSTHROUGH_RECOVERY,
)


clean_engines = faults_cleared_after_each(*MAIN, *SOLO)


def check_shape(route: str, answer: dict[str, Any]) -> None:
    if route == "/tokenize":
        assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    elif route == "/detokenize":
        assert answer == {"prompt": " t1 t2 t3"}
    elif route in ("/rerank", "/v1/rerank"):
        assert set(answer) == {"id", "model", "usage", "results"} and len(answer["results"]) == 3
    else:
        kind = {"/v1/embeddings": "embedding", "/pooling": "pooling"}.get(route, "score")
        assert answer["object"] == "list" and answer["model"] == MODEL
        assert {d["object"] for d in answer["data"]} == {kind}


def served(fleet: FakeFleet, tag: str, engines: list[str]) -> dict[str, list[dict[str, Any]]]:
    return {name: recs for name in engines if (recs := records(fleet, name, tag))}


async def test_each_route_reaches_one_consumer_with_no_transfer_params(router: RouterProcess, fleet: FakeFleet) -> None:
    for route in PASSTHROUGH_ROUTES:
        tag = unique_prompt().split()[0]
        rid = "pt-" + tag
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        body = body_for(route, tag, kv_transfer_params=CLIENT_KV)
        headers = {**KEY, "x-request-id": rid, "traceparent": trace}
        reply = await send(router.url, route, body, headers=headers)
        assert reply.status == 200, (route, reply.raw)
        assert reply.headers["content-type"].startswith("application/json")
        assert reply.headers["x-request-id"] == rid
        check_shape(route, reply.json)
        got = served(fleet, tag, MAIN)
        assert list(got) in (["d0"], ["d1"]), (route, got)  # one engine, a consumer
        (rec,) = next(iter(got.values()))
        assert rec["path"] == route and rec["phase"] == "passthrough"
        sent = dict(body)
        del sent["kv_transfer_params"]
        assert rec["body"] == sent  # the client's body, re-encoded, minus its transfer params
        assert rec["headers"]["authorization"] == f"Bearer {ENGINE_KEY}"  # never the client's key
        assert rec["headers"]["traceparent"] == trace
        assert re.fullmatch(r"[0-9a-f]{32}", rec["headers"]["x-request-id"])  # a backend id, as on legs


async def test_the_answer_is_relayed_unchanged(router: RouterProcess) -> None:
    text = unique_prompt(5)
    reply = await send(router.url, "/tokenize", {"prompt": text, "return_token_strs": True}, headers=KEY)
    assert reply.status == 200  # no model: the fleet's only one
    assert reply.json == {"count": 5, "max_model_len": 1048576,  # the session fleet's --max-model-len
                          "tokens": token_ids(text), "token_strs": text.split()}


async def test_consumers_first_then_a_producer_when_none_is_admitted(router: RouterProcess, fleet: FakeFleet) -> None:
    tags = [unique_prompt().split()[0] for _ in range(6)]
    for tag in tags:
        assert (await send(router.url, "/tokenize", body_for("/tokenize", tag), headers=KEY)).status == 200
    assert all(records(fleet, "p0", tag) == [] for tag in tags)
    for name in ("d0", "d1"):
        await admin(router, "POST", f"/admin/engines/{name}/eject")
        await wait_state(router, name, "ejected")
    try:
        tag = unique_prompt().split()[0]
        reply = await send(router.url, "/v1/embeddings", body_for("/v1/embeddings", tag), headers=KEY)
        assert reply.status == 200, reply.raw
        assert list(served(fleet, tag, MAIN)) == ["p0"]
    finally:
        for name in ("d0", "d1"):
            await admin(router, "POST", f"/admin/engines/{name}/readmit")
            await wait_state(router, name, "admitted")


async def _inflight(router: RouterProcess, name: str) -> int:
    return int((await engine_entry(router, name))["inflight"]["decode"])


async def test_least_loaded_consumer_and_the_slot_held_while_it_runs(router: RouterProcess, fleet: FakeFleet) -> None:
    slow_tag = unique_prompt().split()[0]
    slow_body = body_for("/tokenize", slow_tag, narwhal_fake={"passthrough": {"delay_headers_s": 3}})
    slow = asyncio.ensure_future(send(router.url, "/tokenize", slow_body, headers=KEY))
    for _ in range(200):
        got = served(fleet, slow_tag, ["d0", "d1"])
        if got:
            break
        await asyncio.sleep(0.02)
    (busy,) = got
    (idle,) = {"d0", "d1"} - {busy}
    assert await _inflight(router, busy) == 1  # the running request holds a decode slot
    tags = [unique_prompt().split()[0] for _ in range(6)]
    for tag in tags:
        assert (await send(router.url, "/tokenize", body_for("/tokenize", tag), headers=KEY)).status == 200
        assert list(served(fleet, tag, MAIN)) == [idle]
    reply = await slow
    assert reply.status == 200
    assert await _inflight(router, busy) == 0


async def test_client_keys_are_required(router: RouterProcess, fleet: FakeFleet) -> None:
    for route in PASSTHROUGH_ROUTES:
        tag = unique_prompt().split()[0]
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = await send(router.url, route, body_for(route, tag), headers=headers)
            assert reply.status == 401 and reply.headers["x-narwhal-error"] == "unauthorized"
            assert error_of(reply) == {"message": "invalid or missing API key", "type": "unauthorized",
                                       "param": None, "code": 401}
        assert served(fleet, tag, MAIN) == {}


async def test_admission_refusals_in_openai_shape(router: RouterProcess) -> None:
    cases = [
        (b"{nope", {}, 400, "bad_request"),
        (b"[1, 2]", {}, 400, "bad_request"),
        (orjson.dumps({"model": 7, "prompt": "x"}), {}, 400, "bad_request"),
        (orjson.dumps({"model": "nope", "prompt": "x"}), {}, 404, "model_not_found"),
        (b'{"prompt": "x"}', {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        (orjson.dumps({"prompt": "x" * 70000}), {}, 413, "payload_too_large"),
    ]
    for raw, headers, status, reason in cases:
        reply = await send(router.url, "/tokenize", raw=raw, headers={**KEY, **headers})
        assert (reply.status, reply.headers["x-narwhal-error"]) == (status, reason), reply.raw
        error = error_of(reply)
        assert (error["type"], error["code"]) == (reason, status)
    reply = await send(router.url, "/tokenize", {"model": "nope", "prompt": "x"}, headers=KEY)
    assert error_of(reply)["message"] == "The model `nope` does not exist."


async def test_the_request_deadline_bounds_the_engine(router: RouterProcess) -> None:
    body = body_for("/tokenize", unique_prompt().split()[0], narwhal_fake={"passthrough": {"delay_headers_s": 2}})
    reply = await send(router.url, "/tokenize", body, headers={**KEY, "x-narwhal-deadline-s": "0.5"})
    assert (reply.status, reply.headers["x-narwhal-error"]) == (504, "deadline_exceeded")
    assert error_of(reply)["code"] == 504


def _metric(router: RouterProcess, route: str, code: int, text: str | None = None) -> float:
    text = scrape(router) if text is None else text
    pattern = (
        r'narwhal_requests_total\{code="' + str(code) + '",endpoint="' + re.escape(route)
        + '",model="' + re.escape(MODEL) + r'"\} ([0-9.]+)'
    )
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


async def test_access_log_line_and_request_counter(router: RouterProcess) -> None:
    before = _metric(router, "/v1/rerank", 200, at_rest(router, "narwhal_requests_total"))
    rid = "pt-log-" + unique_prompt().split()[0]
    reply = await send(router.url, "/v1/rerank", body_for("/v1/rerank", rid), headers={**KEY, "x-request-id": rid})
    assert reply.status == 200
    entry = access_line(router, rid)
    assert entry["endpoint"] == "/v1/rerank" and entry["mode"] == "passthrough" and entry["model"] == MODEL
    assert entry["status"] == 200 and entry["attempts"] == 1 and entry["reason"] is None
    assert entry["consumer"] in ("d0", "d1") and entry["producer"] is None and entry["ttft_s"] is None
    assert 0 < entry["first_byte_s"] <= entry["total_s"]
    wait_until(lambda: _metric(router, "/v1/rerank", 200) == before + 1, 5, "narwhal_requests_total counted it")


# -- solo: p1 -> d2, two served models, breakers that eject after 3 ------------------------------


async def test_model_is_required_when_two_are_served(solo: RouterProcess, fleet: FakeFleet) -> None:
    tag = unique_prompt().split()[0]
    reply = await send(solo.url, "/tokenize", {"prompt": f"{tag} x"})
    assert (reply.status, reply.headers["x-narwhal-error"]) == (400, "bad_request")
    assert error_of(reply) == {"message": "'model' is required", "type": "bad_request", "param": None, "code": 400}
    assert served(fleet, tag, SOLO) == {}


async def _tokenize(solo: RouterProcess, fault: dict[str, Any] | None = None) -> tuple[Any, str]:
    tag = unique_prompt().split()[0]
    extra = {"narwhal_fake": {"passthrough": fault}} if fault else {}
    return await send(solo.url, "/tokenize", body_for("/tokenize", tag, **extra)), tag


async def _streak(solo: RouterProcess, expected: int) -> dict[str, Any]:
    for _ in range(250):
        entry = await engine_entry(solo, "d2")
        if entry["failure_streak"] == expected:
            return entry
        await asyncio.sleep(0.02)
    raise AssertionError(f"d2's streak never reached {expected}: {entry}")


async def test_engine_4xx_is_relayed_and_never_counted(solo: RouterProcess) -> None:
    for status in (400, 429):
        reply, _ = await _tokenize(solo, {"status": status, "message": f"engine says {status}"})
        assert (reply.status, reply.headers["x-narwhal-error"]) == (status, "engine_client_error")
        assert error_of(reply) == {"message": f"engine says {status}", "type": "engine_client_error",
                                   "param": None, "code": status}
    reply, _ = await _tokenize(solo, {"status": 500})  # counted: the two before it were not
    assert reply.status == 502
    entry = await _streak(solo, 1)
    assert entry["state"] == "admitted" and entry["last_failure"]["reason"] == "engine_5xx"
    await admin(solo, "POST", "/admin/engines/d2/readmit")
    await _streak(solo, 0)


async def test_engine_faults_map_to_502_504_and_eject_after_three(solo: RouterProcess, fleet: FakeFleet) -> None:
    cases = [
        ({"status": 503}, 502, "engine_5xx", "engine d2 answered HTTP 503 (decode)"),
        ({"reset": True}, 502, "engine_unreachable", "engine d2 closed the connection before a response (decode)"),
        ({"delay_headers_s": 4}, 504, "first_token_timeout", "engine d2 sent no answer within 2.5s"),
    ]
    try:
        for fault, status, reason, message in cases:
            reply, tag = await _tokenize(solo, fault)
            assert (reply.status, reply.headers["x-narwhal-error"]) == (status, reason), reply.raw
            assert error_of(reply) == {"message": message, "type": reason, "param": None, "code": status}
            assert list(served(fleet, tag, SOLO)) == ["d2"]
        entry = await wait_state(solo, "d2", "ejected", timeout=5)
        assert entry["failure_streak"] == 3 and entry["last_failure"]["reason"] == "first_token_timeout"
        # The only consumer is out: the producer answers.
        reply, tag = await _tokenize(solo)
        assert reply.status == 200 and list(served(fleet, tag, SOLO)) == ["p1"]
    finally:
        await admin(solo, "POST", "/admin/engines/d2/readmit")
        await wait_state(solo, "d2", "admitted")


async def test_a_refusing_engine_is_unreachable_and_placed_last(solo: RouterProcess, fleet: FakeFleet) -> None:
    seen = solo.log_text().count("engine d2: unreachable")
    fleet.control_request("POST", "/engines/d2/stop")
    try:
        # docs/behaviour.md "Recovery" (round 4): once d2 refused a connection it is unreachable and comes last, so the
        # producer takes the next requests instead of d2 answering every one 502.
        reply, _ = await _tokenize(solo)
        if error_of(reply)["message"] == "engine d2 closed the connection before a response (decode)":
            # A kept-alive connection the stopping engine closed under the request (a POST is never
            # resent): the next request connects afresh, and is refused.
            reply, _ = await _tokenize(solo)
        assert (reply.status, reply.headers["x-narwhal-error"]) == (502, "engine_unreachable"), reply.raw
        assert error_of(reply)["message"] == "engine d2 is unreachable (decode)"
        # The supervisor's line is written once the flag is published (every worker's next request
        # reads it); a worker's own answer could come from its local mark alone.
        wait_until(lambda: solo.log_text().count("engine d2: unreachable") > seen, 5, "d2 published unreachable")
        for _ in range(3):
            reply, tag = await _tokenize(solo)
            assert reply.status == 200 and list(served(fleet, tag, SOLO)) == ["p1"], reply.raw
        entry = await engine_entry(solo, "d2")
        assert entry["unreachable"] is True and entry["last_failure"]["reason"] == "engine_unreachable"
    finally:
        fleet.control_request("POST", "/engines/d2/start")
        await admin(solo, "POST", "/admin/engines/d2/readmit")
        await wait_state(solo, "d2", "admitted")
