"""Shared by the hostile-client tests: raw HTTP reads, the property every answer keeps (a 4xx in
OpenAI's shape or a correct 200, never a router 5xx or a traceback) and the workers' liveness."""

from __future__ import annotations

import os
import socket

import orjson

from narwhal.testing.harness import RouterProcess, children_of
from tests.real_gunicorn.support import (
    Answer,
    assert_openai_error,
    http_request,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
IDLE_CONNECTIONS = int(os.environ.get("HOSTILE_IDLE_CONNECTIONS", "2000"))


# -- small raw-HTTP helpers ------------------------------------------------------------------


def read_raw_response(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP/1.1 response with a Content-Length body off a raw socket."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a full response head: {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return status, headers, rest[:length]


def assert_sane(answer: Answer, stream_hint: bool | None = None) -> None:
    """The property: a 4xx in the OpenAI shape (router's own: with x-narwhal-error) or a correct 200."""
    assert b"Traceback" not in answer.body, answer.body[:2000]
    assert answer.status < 500, (answer.status, answer.headers, answer.body[:2000])
    if answer.status == 200:
        ctype = answer.headers.get("content-type", "")
        if ctype.startswith("text/event-stream"):
            events = [e[6:] for e in answer.body.split(b"\n\n") if e.startswith(b"data: ")]
            assert events and events[-1] == b"[DONE]", answer.body[-500:]
            for data in events[:-1]:
                assert "error" not in orjson.loads(data), data
        else:
            obj = orjson.loads(answer.body)
            assert isinstance(obj.get("choices"), list) and obj["choices"], obj
        return
    assert 400 <= answer.status < 500, answer.status
    err = assert_openai_error(answer.status, answer.headers, answer.body)
    if err["type"] == "engine_client_error":
        return  # an engine 4xx, passed through and normalised
    assert answer.headers.get("x-narwhal-error") == err["type"], (answer.headers, err)


def worker_pids(router: RouterProcess) -> list[int]:
    return sorted(children_of(router.proc.pid))


def assert_alive(router: RouterProcess, pids: list[int]) -> None:
    answer = http_request(router, "GET", "/health", timeout=10)
    assert answer.status == 200, answer.body
    assert worker_pids(router) == pids, "a router worker died (or was replaced)"
    assert router.proc.poll() is None
