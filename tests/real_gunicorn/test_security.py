"""Security properties of the real router (gunicorn, 2 workers) over p2 → d2.

Client ``kv_transfer_params`` never reach an engine; admin and client auth; the client's
Authorization never reaches an engine; no engine address or traceback in any error body;
documented size limits enforced in OpenAI's shape; secrets and prompts never logged.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    Reply,
    chat,
    completion,
    error_of,
    records,
    router_addr,
    send,
    start_router,
    unique_prompt,
    wait_until,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENGINE_SECRET = "engine-secret-" + uuid.uuid4().hex
AUTH_ENGINE_KEY = "engine-key-" + uuid.uuid4().hex
ADMIN_TOKEN = "s3cret"
CLIENT_KEY = "client-key-" + uuid.uuid4().hex
MAX_BODY = 65536
PAIR = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
# Prompts sent through open_router: none of them may show up in its logs.
SENT_PROMPTS: list[str] = []


@pytest.fixture(scope="module")
def open_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """No admin token, no client keys; a secret engine key; debug logs; short engine timeouts."""
    tmp = tmp_path_factory.mktemp("security_open")
    proc = start_router(
        fleet,
        [dict(e) for e in PAIR],
        tmp,
        server={"max_body_bytes": MAX_BODY},
        engine={
            "api_key": ENGINE_SECRET,
            "prefill_timeout_s": 1,
            "first_token_timeout_s": 1,
            "decode_read_timeout_s": 0.5,
        },
        log={"level": "debug", "access_log": str(tmp / "access.log")},
    )
    proc.access_log_path = str(tmp / "access.log")  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def auth_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """Admin token and client keys configured."""
    tmp = tmp_path_factory.mktemp("security_auth")
    proc = start_router(
        fleet,
        [dict(e) for e in PAIR],
        tmp,
        server={"admin_token": ADMIN_TOKEN, "api_keys": ["other-key", CLIENT_KEY]},
        engine={"api_key": AUTH_ENGINE_KEY},
        log={"level": "debug", "access_log": str(tmp / "access.log")},
    )
    proc.access_log_path = str(tmp / "access.log")  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def tracked(prompt: str) -> str:
    SENT_PROMPTS.append(prompt)
    return prompt


def assert_router_error(reply: Reply, status: int, reason: str) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.raw[:500])
    err = error_of(reply)
    assert err["type"] == reason and err["code"] == status and err["param"] is None, err
    assert reply.headers.get("x-narwhal-error") == reason, dict(reply.headers)
    return err


def all_records(fleet: FakeFleet, prompt: str) -> list[dict[str, Any]]:
    return records(fleet, "p2", prompt) + records(fleet, "d2", prompt)


# -- client kv_transfer_params --------------------------------------------------------------

EVIL = {
    "do_remote_prefill": True,
    "do_remote_decode": True,
    "remote_engine_id": "evil-engine",
    "remote_host": "evil.example",
    "remote_port": 46_811,
    "remote_block_ids": [1, 2, 3],
}


def _raw_with_duplicates(body: dict[str, Any]) -> bytes:
    """The body with kv_transfer_params three times over (first, middle and last key)."""
    inner = orjson.dumps(body)[1:-1]
    evil = orjson.dumps(EVIL)
    return (
        b'{"kv_transfer_params":'
        + evil
        + b","
        + inner
        + b',"kv_transfer_params":'
        + evil
        + b',"kv_transfer_params":{"remote_host":"evil.example"}}'
    )


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("spelling", ["top_level", "duplicates", "null", "string", "list"])
async def test_client_kv_transfer_params_never_reach_an_engine(
    open_router: RouterProcess, fleet: FakeFleet, endpoint: str, stream: bool, spelling: str
) -> None:
    prompt = tracked(unique_prompt())
    body = (completion if endpoint == COMPLETIONS else chat)(prompt, stream=stream, max_tokens=3)
    raw = None
    if spelling == "top_level":
        body["kv_transfer_params"] = EVIL
    elif spelling == "duplicates":
        raw = _raw_with_duplicates(body)
    else:
        body["kv_transfer_params"] = {"null": None, "string": "evil.example", "list": [EVIL]}[spelling]
    reply = await send(open_router.url, endpoint, body if raw is None else None, raw=raw)
    assert reply.status == 200, reply.raw[:500]
    recs = all_records(fleet, prompt)
    prefills = [r for r in recs if r["phase"] == "prefill"]
    decodes = [r for r in recs if r["phase"] == "decode"]
    assert len(prefills) == 1 and len(decodes) == 1, recs
    for rec in recs:
        dumped = orjson.dumps(rec["body"])
        assert b"evil" not in dumped, rec["body"]
        kv = rec["body"].get("kv_transfer_params")
        assert kv is None or kv.get("remote_port") != 46_811, rec["body"]
    # What the engines did get is the router's own: P a fresh request, D P's descriptor.
    prefill_kv = prefills[0]["body"]["kv_transfer_params"]
    assert prefill_kv["do_remote_decode"] is True and prefill_kv.get("do_remote_prefill") is not True, prefill_kv
    assert all(v is None for k, v in prefill_kv.items() if k.startswith("remote_")), prefill_kv
    decode_kv = decodes[0]["body"]["kv_transfer_params"]
    assert decode_kv["remote_engine_id"] == fleet.stats("p2")["engine_id"]
    assert decode_kv["remote_host"] != "evil.example"


# -- admin routes ---------------------------------------------------------------------------

ADMIN_ROUTES = [("GET", "/admin/engines"), ("POST", "/admin/engines/p2/readmit")]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize("auth", [None, f"Bearer {ADMIN_TOKEN}"], ids=["no_auth", "bearer"])
async def test_admin_api_is_404_without_an_admin_token(
    open_router: RouterProcess, method: str, path: str, auth: str | None
) -> None:
    headers = {"Authorization": auth} if auth else {}
    reply = await send(open_router.url, path, method=method, headers=headers)
    assert_router_error(reply, 404, "not_found")


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize(
    "auth",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer wrong",
        f"Bearer {ADMIN_TOKEN}x",
        f"Bearer {ADMIN_TOKEN[:-1]}",
        "Basic czNjcmV0OnMzY3JldA==",
        f"Basic {ADMIN_TOKEN}",
        ADMIN_TOKEN,
        f"Token {ADMIN_TOKEN}",
        f"Bearer {CLIENT_KEY}",
    ],
    ids=[
        "missing",
        "empty",
        "bearer_no_value",
        "bearer_space",
        "wrong",
        "longer",
        "prefix",
        "basic_b64",
        "basic",
        "no_scheme",
        "other_scheme",
        "client_key",
    ],
)
async def test_admin_api_refuses_a_missing_wrong_or_malformed_token(
    auth_router: RouterProcess, method: str, path: str, auth: str | None
) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    reply = await send(auth_router.url, path, method=method, headers=headers)
    assert_router_error(reply, 401, "unauthorized")
    assert ADMIN_TOKEN not in reply.raw.decode()


async def test_admin_api_answers_the_right_token(auth_router: RouterProcess, fleet: FakeFleet) -> None:
    reply = await send(
        auth_router.url, "/admin/engines", method="GET", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert reply.status == 200, reply.raw
    engines = {e["name"]: e for e in reply.json["engines"]}
    assert set(engines) == {"p2", "d2"}
    assert engines["p2"]["url"] == fleet.engines["p2"]  # the admin API is the one place URLs appear
    reply = await send(auth_router.url, "/admin/engines/p2/readmit", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status == 200, reply.raw
    assert reply.json["name"] == "p2" and reply.json["state"] == "admitted"


# -- client API keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "auth",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer nope",
        f"Bearer {CLIENT_KEY}x",
        f"Basic {CLIENT_KEY}",
        CLIENT_KEY,
        f"Bearer {ADMIN_TOKEN}",
    ],
    ids=["missing", "empty", "bearer_no_value", "bearer_space", "wrong", "longer", "basic", "no_scheme", "admin_token"],
)
@pytest.mark.parametrize(("method", "path"), [("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models")])
async def test_client_keys_are_required_on_v1(
    auth_router: RouterProcess, fleet: FakeFleet, auth: str | None, method: str, path: str
) -> None:
    # SPEC §2: with server.api_keys set, all of /v1/* requires `Authorization: Bearer <key>`,
    # GET /v1/models included.
    prompt = unique_prompt()
    body = None
    if method == "POST":
        body = (completion if path == COMPLETIONS else chat)(prompt, max_tokens=2)
    headers = {"Authorization": auth} if auth is not None else {}
    reply = await send(auth_router.url, path, body, method=method, headers=headers)
    err = assert_router_error(reply, 401, "unauthorized")
    assert CLIENT_KEY not in err["message"]
    if method == "POST":
        assert all_records(fleet, prompt) == []  # refused before anything reached an engine


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
async def test_the_right_client_key_works_and_is_never_forwarded(
    auth_router: RouterProcess, fleet: FakeFleet, endpoint: str
) -> None:
    prompt = unique_prompt()
    body = (completion if endpoint == COMPLETIONS else chat)(prompt, max_tokens=2)
    reply = await send(auth_router.url, endpoint, body, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert reply.status == 200, reply.raw
    models = await send(auth_router.url, "/v1/models", method="GET", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert models.status == 200 and [m["id"] for m in models.json["data"]] == [MODEL]
    recs = all_records(fleet, prompt)
    assert {r["phase"] for r in recs} == {"prefill", "decode"}
    for rec in recs:
        assert rec["headers"].get("authorization") == f"Bearer {AUTH_ENGINE_KEY}", rec["headers"]


async def test_without_client_keys_the_client_authorization_is_not_forwarded(
    open_router: RouterProcess, fleet: FakeFleet
) -> None:
    prompt = tracked(unique_prompt())
    reply = await send(
        open_router.url, COMPLETIONS, completion(prompt, max_tokens=2), headers={"Authorization": "Bearer client-own"}
    )
    assert reply.status == 200, reply.raw
    recs = all_records(fleet, prompt)
    assert len(recs) == 2
    for rec in recs:
        assert rec["headers"].get("authorization") == f"Bearer {ENGINE_SECRET}", rec["headers"]


# -- no engine address or traceback in any error body ----------------------------------------


def _forbidden_strings(fleet: FakeFleet) -> list[str]:
    out = ["Traceback", "localhost", 'File "']
    for url in fleet.engines.values():
        parts = urlsplit(url)
        out += [url, url.rstrip("/"), f"{parts.hostname}:{parts.port}", f":{parts.port}"]
    control = urlsplit(fleet.control)
    out += [f"{control.hostname}:{control.port}", f":{control.port}"]
    return out


def assert_no_leak(fleet: FakeFleet, reply: Reply) -> None:
    text = reply.raw.decode("utf-8", "replace") + " ".join(f"{k}: {v}" for k, v in reply.headers.items())
    for needle in _forbidden_strings(fleet):
        assert needle not in text, (needle, text[:2000])


def _terminal_error(reply: Reply) -> dict[str, Any]:
    events = reply.events
    assert events and b"[DONE]" not in events, reply.raw[-500:]
    last = orjson.loads(events[-1])
    assert set(last) == {"error"}, last
    return last["error"]


FAULT_CASES: list[tuple[str, dict[str, Any], bool, int, str]] = [
    # (case, narwhal_fake, stream, status, reason); status 200 = a terminal error event after a token
    ("prefill_500", {"prefill": {"status": 500, "message": "prefill exploded"}}, False, 502, "engine_5xx"),
    ("decode_503", {"decode": {"status": 503, "message": "decode exploded"}}, True, 502, "engine_5xx"),
    ("prefill_400", {"prefill": {"status": 400, "message": "bad sampling params"}}, False, 400, "engine_client_error"),
    ("decode_429", {"decode": {"status": 429, "message": "slow down"}}, True, 429, "engine_client_error"),
    (
        "flat_4xx",
        {"prefill": {"status": 422, "flat_error": True, "message": "flat"}},
        False,
        422,
        "engine_client_error",
    ),
    ("prefill_reset", {"prefill": {"reset": True}}, False, 502, "engine_unreachable"),
    # (No decode-leg reset: a crashed consumer frees nothing and the producer keeps the handoff's
    # blocks until its lease, by design; the module's held-blocks check would flag it.)
    ("prefill_timeout", {"prefill": {"delay_headers_s": 1.6}}, False, 504, "prefill_timeout"),
    ("first_token_timeout", {"decode": {"delay_first_token_s": 1.6}}, True, 504, "first_token_timeout"),
    ("decode_silence", {"decode": {"silence_after": 1, "silence_s": 1.2}}, True, 200, "decode_silence"),
    ("bad_port", {"prefill": {"descriptor": "bad_port"}}, True, 502, "invalid_handoff"),
    ("mooncake", {"prefill": {"descriptor": "mooncake"}}, False, 502, "invalid_handoff"),
    ("no_engine_id", {"prefill": {"descriptor": "no_engine_id"}}, True, 502, "invalid_handoff"),
    ("disconnect_before_token", {"decode": {"close_after": 0}}, True, 502, "engine_disconnect"),
    ("disconnect_after_token", {"decode": {"close_after": 2}}, True, 200, "engine_disconnect"),
    ("done_before_token", {"decode": {"done_before_token": True}}, True, 502, "done_before_token"),
    (
        "stream_error",
        {"decode": {"stream_error": {"code": 500, "message": "kaboom"}}},
        True,
        500,
        "engine_stream_error",
    ),
    (
        "stream_error_late",
        {"decode": {"stream_error": {"code": 500, "message": "kaboom", "after": 2}}},
        True,
        200,
        "engine_stream_error",
    ),
]


@pytest.mark.parametrize(("case", "fake", "stream", "status", "reason"), FAULT_CASES, ids=[c[0] for c in FAULT_CASES])
async def test_engine_failures_never_leak_an_address_or_traceback(
    open_router: RouterProcess, fleet: FakeFleet, case: str, fake: dict, stream: bool, status: int, reason: str
) -> None:
    prompt = tracked(unique_prompt())
    reply = await send(open_router.url, COMPLETIONS, completion(prompt, stream=stream, max_tokens=6, fake=fake))
    assert_no_leak(fleet, reply)
    if status == 200:
        assert reply.status == 200, reply.raw[:500]
        err = _terminal_error(reply)
        assert err["type"] == reason, err
    else:
        assert reply.status == status, (reply.status, reply.raw[:500])
        err = error_of(reply)
        assert err["type"] == reason and err["code"] == status, err
        if reason == "engine_client_error":
            assert fake_message(fake) in err["message"]
        else:
            assert reply.headers.get("x-narwhal-error") == reason
    for name in ("p2", "d2"):
        assert fleet.engines[name] not in err["message"]


def fake_message(fake: dict) -> str:
    return next(iter(fake.values()))["message"]


async def test_unreachable_producer_is_named_not_addressed(open_router: RouterProcess, fleet: FakeFleet) -> None:
    fleet.control_request("POST", "/engines/p2/stop")
    try:
        reply = await send(open_router.url, COMPLETIONS, completion(tracked(unique_prompt()), max_tokens=2))
        assert_no_leak(fleet, reply)
        # Refused at connect (502 engine_unreachable), or already out of placement (503 no_engine).
        assert reply.status in (502, 503), reply.raw
        err = error_of(reply)
        assert err["type"] == {502: "engine_unreachable", 503: "no_engine"}[reply.status], err
        assert reply.headers.get("x-narwhal-error") == err["type"]
    finally:
        fleet.control_request("POST", "/engines/p2/start")
    wait_until(lambda: fleet.stats("p2")["serving"], 10, "p2 serving again")

    async def ok() -> bool:
        r = await send(open_router.url, COMPLETIONS, completion(tracked(unique_prompt()), max_tokens=2))
        return r.status == 200

    for _ in range(100):  # bounded: p2 back in placement within ~10 s
        if await ok():
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("p2 never served again after restart")


@pytest.mark.parametrize(
    ("path", "raw", "headers", "status", "reason"),
    [
        (COMPLETIONS, b"{not json", {}, 400, "bad_request"),
        (COMPLETIONS, orjson.dumps({"model": "nope", "prompt": "x"}), {}, 404, "model_not_found"),
        (COMPLETIONS, orjson.dumps({"model": MODEL, "prompt": "x", "n": 3}), {}, 400, "bad_request"),
        (COMPLETIONS, b"{}", {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        ("/v1/nope", b"{}", {}, 404, "not_found"),
        (COMPLETIONS, b"{}", {"x-narwhal-deadline-s": "nan"}, 400, "bad_request"),
    ],
)
async def test_router_refusals_never_leak(
    open_router: RouterProcess, fleet: FakeFleet, path: str, raw: bytes, headers: dict, status: int, reason: str
) -> None:
    reply = await send(open_router.url, path, raw=raw, headers=headers)
    assert_no_leak(fleet, reply)
    assert_router_error(reply, status, reason)


# -- limits ---------------------------------------------------------------------------------


def _raw_exchange(
    router: RouterProcess, head: bytes, chunks: list[bytes], timeout: float = 10
) -> tuple[int, dict, bytes]:
    """Send a request (head, then body pieces, tolerating an early close) and read the response."""
    host, port = router_addr(router)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(head)
            for c in chunks:
                sock.sendall(c)
        except OSError:
            pass  # the router may answer and close before the whole body is sent
        buf = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            buf += data
            if b"\r\n\r\n" in buf:
                head_part, _, rest = buf.partition(b"\r\n\r\n")
                length = [ln for ln in head_part.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                if length and len(rest) >= int(length[0].split(b":")[1]):
                    break
    head_part, _, rest = buf.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    assert lines and lines[0].startswith("HTTP/1."), buf[:300]
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), hdrs, rest


def _assert_raw_error(status: int, hdrs: dict, body: bytes, want: int, reason: str) -> None:
    assert status == want, (status, hdrs, body[:300])
    assert b"Traceback" not in body
    obj = orjson.loads(body)
    assert obj == {"error": {"message": obj["error"]["message"], "type": reason, "param": None, "code": want}}, obj
    assert hdrs.get("x-narwhal-error") == reason, hdrs


async def test_body_over_max_body_bytes_is_413(open_router: RouterProcess, fleet: FakeFleet) -> None:
    prompt = unique_prompt()
    body = completion(prompt, max_tokens=2)
    body["pad"] = "x" * MAX_BODY
    reply = await send(open_router.url, COMPLETIONS, body)
    assert_router_error(reply, 413, "payload_too_large")
    assert all_records(fleet, prompt) == []
    # Just under the limit is fine.
    body["pad"] = "x" * (MAX_BODY - 1000)
    assert (await send(open_router.url, COMPLETIONS, body)).status == 200


def test_chunked_body_over_max_body_bytes_is_413(open_router: RouterProcess) -> None:
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    piece = b"x" * 8192
    chunks = [b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(MAX_BODY // 8192 + 4)] + [b"0\r\n\r\n"]
    status, hdrs, body = _raw_exchange(open_router, head, chunks)
    _assert_raw_error(status, hdrs, body, 413, "payload_too_large")


async def test_headers_over_max_header_bytes_are_431(open_router: RouterProcess) -> None:
    # Many fields, each small, together over server.max_header_bytes (16 KiB).
    headers = {f"x-pad-{i}": "v" * 1000 for i in range(20)}
    reply = await send(open_router.url, COMPLETIONS, completion(unique_prompt(), max_tokens=2), headers=headers)
    assert_router_error(reply, 431, "header_too_large")
    reply = await send(open_router.url, "/health", method="GET", headers=headers)
    assert_router_error(reply, 431, "header_too_large")


@pytest.mark.parametrize(
    ("extra_head", "want", "reason"),
    [
        pytest.param("x-big: " + "v" * 20000 + "\r\n", 431, "header_too_large", id="one_field_over_limit"),
        pytest.param(None, 431, "header_too_large", id="request_line_over_limit"),
        pytest.param("Content-Type: application/json\r\n", 400, "bad_request", id="duplicate_content_type"),
        # More than 128 fields: "Request Header Fields Too Large" is the status made for it.
        pytest.param("".join(f"x-{i}: a\r\n" for i in range(200)), 431, "header_too_large", id="too_many_fields"),
    ],
)
def test_http_parser_refusals_are_in_the_openai_shape(
    open_router: RouterProcess, extra_head: str | None, want: int, reason: str
) -> None:
    # Requests refused by aiohttp's HTTP parser before the app runs (a field or request line over
    # the limit, too many fields, a duplicated singleton header) are answered in the OpenAI shape
    # too (narwhal/front/server.py), never echoing the client's bytes.
    body = orjson.dumps(completion(unique_prompt(), max_tokens=2))
    path = COMPLETIONS if extra_head is not None else COMPLETIONS + "?q=" + "a" * 20000
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra_head or ''}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    status, hdrs, resp = _raw_exchange(open_router, head, [body])
    assert b"vvvvvvvv" not in resp and b"aaaaaaaa" not in resp  # never echo the client's bytes back
    _assert_raw_error(status, hdrs, resp, want, reason)


# -- secrets and prompts never logged (last: after every failure above) ------------------------


def _log_texts(router: RouterProcess) -> str:
    texts = []
    for path in (router.log_path, router.access_log_path):  # type: ignore[attr-defined]
        with open(path, "rb") as f:
            texts.append(f.read().decode("utf-8", "replace"))
    return "\n".join(texts)


def test_secrets_and_prompts_are_never_logged(open_router: RouterProcess, auth_router: RouterProcess) -> None:
    assert len(SENT_PROMPTS) > 20  # the traffic above ran, failures included
    text = _log_texts(open_router)
    assert text.strip(), "no log output at all: the check below would be vacuous"
    assert ENGINE_SECRET not in text
    leaked = [p.split()[0] for p in SENT_PROMPTS if p.split()[0] in text]
    assert leaked == [], f"{len(leaked)} prompts found in the router's logs"
    text = _log_texts(auth_router)
    for secret in (AUTH_ENGINE_KEY, CLIENT_KEY, ADMIN_TOKEN):
        assert secret not in text, secret
