"""The direct relay (narwhal.engines.relay) through real gunicorn: long paced streams.

After a few spans the decode stream is relayed inside the connection's data callback; these
tests pace the fake engine (a token every 10 ms, so every token is its own span) and put each
stream rule of docs/behaviour.md "Failure semantics" *after* the relay has taken over: full text in order, the end, an
engine that closes, goes silent, keeps a stream alive with metadata, or reports an error, the
request deadline, and a client that reads slowly enough to fill the router's buffers.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from urllib.parse import urlsplit

import aiohttp
import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    chat,
    completion,
    expected_text,
    send,
    terminal_error,
    unique_prompt,
    wait_until,
)

PACED = {"token_delay_s": 0.01}


async def test_a_long_paced_stream_arrives_whole_and_in_order(router: RouterProcess) -> None:
    body = completion(unique_prompt(), max_tokens=40, fake={"decode": PACED})
    reply = await send(router.url, "/v1/completions", body)
    assert reply.status == 200
    assert reply.text == expected_text(40)
    assert reply.events[-1] == b"[DONE]"
    assert reply.events.count(b"[DONE]") == 1


async def test_chat_stream_through_the_relay(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/chat/completions", chat(unique_prompt(), max_tokens=20, fake={"decode": PACED}))
    assert reply.status == 200
    assert reply.text == expected_text(20)
    assert reply.events[-1] == b"[DONE]"


async def test_engine_closing_mid_relay_ends_with_engine_disconnect(router: RouterProcess) -> None:
    fake = {"decode": {**PACED, "close_after": 12}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=30, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(12)
    err = terminal_error(reply)
    assert err["type"] == "engine_disconnect" and err["code"] == 502
    assert "closed the stream before [DONE]" in err["message"]


async def test_silence_mid_relay_ends_with_decode_silence(router: RouterProcess) -> None:
    fake = {"decode": {**PACED, "silence_after": 10, "silence_s": 5}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=20, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(10)
    err = terminal_error(reply)
    assert err["type"] == "decode_silence" and err["code"] == 504
    assert err["message"].startswith("engine went silent between tokens")


async def test_metadata_mid_relay_resets_the_silence_timer(router: RouterProcess) -> None:
    fake = {"decode": {**PACED, "silence_after": 10, "silence_s": 3, "heartbeat_s": 0.5}}
    reply = await send(router.url, "/v1/chat/completions", chat(unique_prompt(), max_tokens=14, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(14)
    assert reply.events[-1] == b"[DONE]"


async def test_in_stream_error_mid_relay_is_the_terminal_event(router: RouterProcess) -> None:
    fake = {"decode": {**PACED, "stream_error": {"code": 503, "message": "engine overloaded", "after": 10}}}
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=20, fake=fake))
    assert reply.status == 200
    assert reply.text == expected_text(10)
    assert terminal_error(reply) == {"message": "engine overloaded", "type": "engine_stream_error", "param": None,
                                     "code": 503}


async def test_the_deadline_ends_a_relayed_stream(solo_router: RouterProcess) -> None:
    # solo_router: decode_read_timeout_s = 0, so only the deadline (1 s, from the client) bounds it.
    fake = {"decode": {**PACED, "silence_after": 10, "silence_s": 3}}
    reply = await send(solo_router.url, "/v1/completions", completion(unique_prompt(), max_tokens=20, fake=fake),
                       headers={"x-narwhal-deadline-s": "1"})
    assert reply.status == 200
    assert reply.text == expected_text(10)
    err = terminal_error(reply)
    assert err["type"] == "deadline_exceeded" and err["code"] == 504


async def test_a_client_leaving_mid_relay_aborts_the_engine_stream(router: RouterProcess, fleet: FakeFleet) -> None:
    consumers = ("d0", "d1")
    before = {n: fleet.stats(n)["aborted_streams"] for n in consumers}
    body = completion(unique_prompt(), max_tokens=400, fake={"decode": {"token_delay_s": 0.02}})
    async with aiohttp.ClientSession() as session:
        resp = await session.post(router.url + "/v1/completions", json=body)
        assert resp.status == 200
        seen = b""
        while seen.count(b'"text"') < 12:  # well past the spans before the relay takes over
            seen += await resp.content.readany()
        resp.close()  # the client goes away mid-relay
    wait_until(
        lambda: sum(fleet.stats(n)["aborted_streams"] - before[n] for n in consumers) == 1,
        10,
        "the consumer saw its stream aborted",
    )
    wait_until(lambda: all(fleet.stats(n)["active_streams"] == 0 for n in consumers), 5, "no stream left open")


def test_a_client_that_stops_reading_gets_every_byte_once_it_reads_again(router: RouterProcess) -> None:
    # ~4.6 MB of SSE to a client that reads nothing until its receive queue stops growing: by
    # then every buffer between the engine and the client is full and the router is holding the
    # stream back for it (the relay stopped, or the write before it waits; which one depends on
    # when the client fell behind, and tests/unit/engines/test_relay.py pins the relay's stop
    # and resume). Then the client reads it all: nothing lost, duplicated or reordered.
    #
    # The receive buffer is fixed (no autotuning) but not tiny: below the loopback segment
    # size (64 KiB) the sender's kernel waits for its 200 ms persist timer before every
    # window-sized segment, and such a stream takes minutes (seen here: 2.8 KB per 208 ms).
    parts = urlsplit(router.url)
    host, port = parts.hostname, parts.port
    assert host and port
    tokens = 20_000
    body = orjson.dumps({"model": MODEL, "prompt": unique_prompt(), "stream": True, "max_tokens": tokens})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.settimeout(30)
    sock.connect((host, port))
    try:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )
        _wait_for_a_full_receive_queue(sock)
        raw = bytearray()
        while piece := sock.recv(65536):
            raw += piece
    finally:
        sock.close()
    head, _, chunked = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in head.lower()
    payload = _dechunk(chunked)
    events = [e[6:] for e in payload.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    texts = [orjson.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == expected_text(tokens)


def _wait_for_a_full_receive_queue(sock: socket.socket) -> None:
    """Until the bytes waiting in ``sock`` are the same in three polls in a row (bounded)."""
    def queued() -> int:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])

    seen: list[int] = []

    def steady() -> bool:
        seen.append(queued())
        return len(seen) >= 3 and seen[-1] > 0 and seen[-1] == seen[-2] == seen[-3]

    wait_until(steady, 15, "the client's receive queue stopped growing")


def test_an_http_1_0_client_gets_an_unframed_stream(router: RouterProcess) -> None:
    # No chunked encoding in HTTP/1.0: the relay writes spans as they are, the end is the close.
    raw = _raw_request(router, completion(unique_prompt(), max_tokens=20, fake={"decode": PACED}), version="1.0")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    assert b"transfer-encoding" not in head.lower()
    events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert body.startswith(b"data: ") and events[-1] == b"[DONE]"
    assert "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected_text(20)


def _raw_request(router: RouterProcess, body: dict[str, object], *, version: str) -> bytes:
    parts = urlsplit(router.url)
    assert parts.hostname and parts.port
    data = orjson.dumps(body)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/{version}\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode() + data
        )
        out = bytearray()
        while piece := sock.recv(65536):
            out += piece
    return bytes(out)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        assert data[end + 2 + size : end + 4 + size] == b"\r\n"
        pos = end + 4 + size
