"""What an error may say, on the real router over p2 → d2: no engine address or traceback in any
error body; the documented size limits enforced in OpenAI's shape. Last, after every failure
above, the logs hold no secret and no prompt.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.security_support import (
    COMPLETIONS,
    MAX_BODY,
    Prompts,
    all_records,
    assert_nothing_secret_logged,
    assert_router_error,
)
from tests.real_gunicorn.support import (
    MODEL,
    Reply,
    completion,
    error_of,
    router_addr,
    send,
    unique_prompt,
    wait_until,
)

SENT = Prompts()


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
    prompt = SENT(unique_prompt())
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
        reply = await send(open_router.url, COMPLETIONS, completion(SENT(unique_prompt()), max_tokens=2))
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
        r = await send(open_router.url, COMPLETIONS, completion(SENT(unique_prompt()), max_tokens=2))
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
    # too (narwhal/worker/server.py), never echoing the client's bytes.
    body = orjson.dumps(completion(unique_prompt(), max_tokens=2))
    path = COMPLETIONS if extra_head is not None else COMPLETIONS + "?q=" + "a" * 20000
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra_head or ''}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    status, hdrs, resp = _raw_exchange(open_router, head, [body])
    assert b"vvvvvvvv" not in resp and b"aaaaaaaa" not in resp  # never echo the client's bytes back
    _assert_raw_error(status, hdrs, resp, want, reason)


def test_failures_sent_no_secret_and_no_prompt_to_the_logs(
    open_router: RouterProcess, auth_router: RouterProcess
) -> None:
    assert_nothing_secret_logged(open_router, auth_router, SENT, at_least=3)
