"""Hostile clients against the real router (gunicorn, 2 workers): garbage bodies, a body in no
encoding, clients that never read, slowloris bodies, and thousands of idle keep-alive connections
(random headers on every route: ``test_client_headers.py``).

The property for every request: a 4xx in OpenAI's error shape (with ``x-narwhal-error``) or a
correct 200 — never a 5xx made by the router, never a traceback, and the workers stay alive.
Everything talks to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import string
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from narwhal.testing.harness import FakeFleet, RouterProcess, children_of
from tests.real_gunicorn.support import (
    MODEL,
    Answer,
    assert_openai_error,
    at_rest,
    http_request,
    router_addr,
    scrape,
    start_router,
    unique_prompt,
    wait_until,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
IDLE_CONNECTIONS = int(os.environ.get("HOSTILE_IDLE_CONNECTIONS", "2000"))


@pytest.fixture(scope="module")
def hostile(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """p2 → d2 with short client-side bounds: a stuck reader is dropped after 2 s, a slow body 408s after 1 s."""
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    proc = start_router(
        fleet,
        engines,
        tmp_path_factory.mktemp("hostile"),
        server={"client_write_timeout_s": 2, "body_read_timeout_s": 1},
    )
    # The master's children (workers and the supervisor) at start: nothing may replace them.
    proc.initial_children = worker_pids(proc)  # type: ignore[attr-defined]
    yield proc
    proc.stop()


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


# -- hypothesis: random bodies ---------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
WEIRD_NUMBERS = st.sampled_from(
    [-1, -(2**63), 2**63, 2**64 + 1, 10**30, -(10**30), 1.5, -0.0, 1e308, -1e308, 2.0, 3, 1e-300]
)
# Every field the router reads, each with values of the wrong type (or out of range).
WRONG = {
    "model": JSON | WEIRD_NUMBERS,
    "stream": st.sampled_from([0, 1, "true", "false", [], {}, 1.0]) | JSON,
    "max_tokens": WEIRD_NUMBERS | st.sampled_from(["5", True, False, [], {}]),
    "max_completion_tokens": WEIRD_NUMBERS | st.sampled_from(["5", True, [], {}]),
    "messages": st.sampled_from(["hi", 1, None, {}, [1], ["x"], [[]], [None]]) | JSON,
    "prompt": st.sampled_from([None, 1, {}, [], [1, "a"], [[1], "a"], [[1.5]], [True], [[True]], 1.5]) | JSON,
    "stream_options": st.sampled_from(["x", 1, [], True]) | JSON,
    "n": WEIRD_NUMBERS | st.sampled_from(["2", [], {}, None, True]),
    "best_of": WEIRD_NUMBERS | st.sampled_from(["2", [], {}, None, True]),
    "prompt_logprobs": WEIRD_NUMBERS | st.sampled_from(["1", [], {}, True, 1]),
}
SAFE_KEY = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8).map(lambda s: "x_" + s)


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _dumps(value: Any, ascii_only: bool) -> bytes:
    # The stdlib encoder: orjson refuses integers beyond 64 bits, clients need not.
    return json.dumps(value, ensure_ascii=ascii_only).encode()


@st.composite
def hostile_request(draw: st.DrawFn) -> tuple[str, bytes]:
    endpoint = draw(st.sampled_from([COMPLETIONS, CHAT]))
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "any_json", "raw"]))
    if kind == "any_json":
        return endpoint, _dumps(draw(JSON), draw(st.booleans()))
    if kind == "raw":
        raw = draw(
            st.sampled_from(
                [
                    b"\xff\xfe\xfd",
                    b'{"model": "\xc3\x28"}',
                    b'{"prompt": "\xed\xa0\x80", "model": "fake-model"}',
                    b'{"model":"fake-model","model":"fake-model","prompt":"a","prompt":"b","max_tokens":2}',
                    b'{"model":"fake-model","prompt":"a","stream":true,"stream":"no","max_tokens":2}',
                    b'{"model":"fake-model","messages":[],"messages":5,"max_tokens":2}',
                    b'{"model":"fake-model","prompt":"a","max_tokens":2,"max_tokens":-1}',
                    b"[" * 5000 + b"]" * 5000,
                    b"{" * 3000,
                    b"",
                    b"null",
                    b'"string"',
                    b"{}",
                    b'{"a":1e400}',
                    b"\x00" * 64,
                ]
            )
            | st.binary(max_size=64)
        )
        return endpoint, raw
    # A valid body, then some fields replaced with wrong types; maybe huge or deep extras.
    stream = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "stream": stream, "max_tokens": draw(st.integers(1, 6))}
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": "hostile " + draw(st.text(max_size=20))}]
    else:
        body["prompt"] = "hostile " + draw(st.text(max_size=20))
    for field in draw(st.sets(st.sampled_from(sorted(WRONG)), max_size=3)):
        body[field] = draw(WRONG[field])
    extras = draw(st.dictionaries(SAFE_KEY, JSON, max_size=3))
    body.update(extras)
    if draw(st.integers(0, 9)) == 0:
        body["x_huge"] = "z" * (1024 * 1024)
    if draw(st.integers(0, 9)) == 0:
        body["x_deep"] = _nested(draw(st.integers(10, 200)))
    # A body with a huge, valid token budget would make the engine stream for minutes.
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 6 < value:
            body[key] = 6
    return endpoint, _dumps(body, draw(st.booleans()))


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(req=hostile_request())
def test_random_bodies_get_a_4xx_or_a_correct_200(hostile: RouterProcess, req: tuple[str, bytes]) -> None:
    endpoint, raw = req
    answer = http_request(hostile, "POST", endpoint, raw, timeout=30)
    event(f"status {answer.status}")
    assert_sane(answer)


def test_workers_survive_the_random_bodies(hostile: RouterProcess) -> None:
    pids = hostile.initial_children  # type: ignore[attr-defined]
    assert len(pids) >= 3  # 2 workers + the supervisor
    # Same property for a fixed set of the nastiest inputs, then the workers are the same.
    for raw in (b"\xff" * 10, b"[" * 100000, b'{"prompt":' * 2000, orjson.dumps({"prompt": "x" * 4_000_000})):
        assert_sane(http_request(hostile, "POST", COMPLETIONS, raw))
    assert_alive(hostile, pids)


# -- headers: random headers on every route are tests/real_gunicorn/test_client_headers.py -----


def test_undecodable_content_encoding_is_a_400(hostile: RouterProcess) -> None:
    # A body that is not in its declared Content-Encoding is the client's error: 400 bad_request
    # (it once escaped read_body as RequestPayloadError and became a 500).
    pids = worker_pids(hostile)
    body = orjson.dumps({"model": MODEL, "prompt": "not gzip", "max_tokens": 2})
    for encoding in ("gzip", "deflate"):
        answer = http_request(hostile, "POST", COMPLETIONS, body, headers=[("Content-Encoding", encoding)])
        assert b"Traceback" not in answer.body
        assert answer.status == 400, (encoding, answer.status, answer.body)
        err = assert_openai_error(answer.status, answer.headers, answer.body)
        assert err["type"] == "bad_request" and answer.headers.get("x-narwhal-error") == "bad_request"
    assert_alive(hostile, pids)


# -- a client that never reads its stream -----------------------------------------------------


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _workers_rss_kb(router: RouterProcess) -> int:
    return sum(_rss_kb(p) for p in children_of(router.proc.pid))


def _log_size(router: RouterProcess) -> int:
    return os.path.getsize(router.log_path)


def _never_reading_client(host: str, port: int, body: bytes) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends one completion and never reads."""
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect((host, port))
    stuck.sendall(
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return stuck


def _log_since(router: RouterProcess, offset: int) -> str:
    with open(router.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def test_a_client_that_never_reads_is_dropped_and_harms_no_one(hostile: RouterProcess, fleet: FakeFleet) -> None:
    # server.client_write_timeout_s = 2: every write to the client is bounded, so a client that
    # never reads is dropped and its engine stream closed like any departed client's.
    host, port = router_addr(hostile)
    before = fleet.stats("d2")
    rss_before = _workers_rss_kb(hostile)
    log_offset = _log_size(hostile)
    prompt = unique_prompt()
    # 2000 tokens (~340 kB of SSE) fit in the loopback socket buffers between the engine, the
    # router and the client: the stream must outlast them for "never reads" to matter.
    body = orjson.dumps({"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 200_000})
    stuck = _never_reading_client(host, port, body)
    try:
        wait_until(
            lambda: fleet.stats("d2")["active_streams"] > before["active_streams"], 10, "the stuck stream starts on d2"
        )
        # Other clients are served meanwhile, promptly.
        rss_peak = _workers_rss_kb(hostile)
        for _ in range(3):
            t0 = time.monotonic()
            answer = http_request(
                hostile,
                "POST",
                COMPLETIONS,
                orjson.dumps({"model": MODEL, "prompt": unique_prompt(), "max_tokens": 3}),
                timeout=10,
            )
            assert answer.status == 200, answer.body
            assert time.monotonic() - t0 < 2.0
            rss_peak = max(rss_peak, _workers_rss_kb(hostile))

        # The router gives up on the stuck reader: the decode is aborted, nothing stays active.
        def dropped() -> bool:
            nonlocal rss_peak
            rss_peak = max(rss_peak, _workers_rss_kb(hostile))
            s = fleet.stats("d2")
            return s["aborted_streams"] > before["aborted_streams"] and s["active_streams"] == 0

        wait_until(dropped, 15, "the stuck client's d2 stream aborted by the router (client_write_timeout_s=2)")
        # Bounded buffering: the stuck stream never piled up in the worker's memory.
        assert rss_peak - rss_before < 50 * 1024, (rss_before, rss_peak)
        # Dropping a slow client is an ordinary outcome, not a crash.
        logged = _log_since(hostile, log_offset)
        # (Only the router's own marker: aiohttp may still log, late, a parser traceback for an
        # earlier test's undecodable body, which that test already answers with a 400.)
        assert "unhandled error" not in logged, logged[-3000:]
    finally:
        stuck.close()
        # Whatever happened, leave d2 idle for the next tests (closing the socket ends the stream).
        wait_until(lambda: fleet.stats("d2")["active_streams"] == 0, 15, "d2 idle after the stuck client left")


# -- slowloris body ---------------------------------------------------------------------------


def test_slowloris_body_gets_408_and_harms_no_one(hostile: RouterProcess) -> None:
    host, port = router_addr(hostile)
    with socket.create_connection((host, port), timeout=10) as slow:
        t0 = time.monotonic()
        slow.sendall(
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n".encode()
            + b'{"model":'
        )
        # Someone else is served while the slow body dribbles (not) in.
        answer = http_request(
            hostile, "POST", COMPLETIONS, orjson.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 2})
        )
        assert answer.status == 200, answer.body
        status, headers, body = read_raw_response(slow, timeout=8)
        elapsed = time.monotonic() - t0
    assert status == 408, body
    assert headers.get("x-narwhal-error") == "request_timeout", headers
    err = assert_openai_error(status, headers, body)
    assert err["type"] == "request_timeout" and err["param"] is None
    assert 0.9 <= elapsed < 5, elapsed


# -- thousands of idle keep-alive connections ------------------------------------------------


def test_many_idle_keepalive_connections_do_not_block_new_clients(hostile: RouterProcess) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE_CONNECTIONS + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    host, port = router_addr(hostile)
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    conns: list[socket.socket] = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            s = socket.create_connection((host, port), timeout=10)
            conns.append(s)
            s.sendall(request)
            status, headers, _ = read_raw_response(s, timeout=10)
            assert status == 200
            assert headers.get("connection", "").lower() != "close"
        # All of them open and idle: new clients are still served, quickly.
        t0 = time.monotonic()
        assert http_request(hostile, "GET", "/health", timeout=10).status == 200
        answer = http_request(
            hostile,
            "POST",
            COMPLETIONS,
            orjson.dumps({"model": MODEL, "prompt": unique_prompt(), "max_tokens": 2}),
            timeout=10,
        )
        assert answer.status == 200, answer.body
        assert time.monotonic() - t0 < 5
        # And the idle ones are still usable (kept alive, not silently dropped).
        for s in conns[:: max(1, len(conns) // 20)]:
            s.sendall(request)
            assert read_raw_response(s, timeout=10)[0] == 200
    finally:
        for s in conns:
            s.close()
    assert_alive(hostile, hostile.initial_children)  # type: ignore[attr-defined]


def test_a_client_that_never_reads_its_whole_answer_is_dropped_too(hostile: RouterProcess) -> None:
    # A non-streaming answer is written under the same client_write_timeout_s (2 s here) as a
    # stream: the request ends (499, its reservations given back) instead of waiting for ever.
    host, port = router_addr(hostile)
    code_499 = re.compile(r'narwhal_requests_total\{code="499",endpoint="/v1/completions",model="[^"]*"\} ([0-9.]+)')

    def dropped_so_far(text: str | None = None) -> float:
        match = code_499.search(scrape(hostile) if text is None else text)
        return float(match.group(1)) if match else 0.0

    before = dropped_so_far(at_rest(hostile, "narwhal_requests_total"))
    # ~8 MB of JSON: more than the loopback socket buffers (4 MiB at most) and a 4 KiB receiver hold.
    body = orjson.dumps({"model": MODEL, "prompt": unique_prompt(), "stream": False, "max_tokens": 1_000_000})
    stuck = _never_reading_client(host, port, body)
    try:
        wait_until(lambda: dropped_so_far() == before + 1, 20, "the non-reading client counted as gone (499)")
        answer = http_request(
            hostile, "POST", COMPLETIONS, orjson.dumps({"model": MODEL, "prompt": unique_prompt(), "max_tokens": 3})
        )
        assert answer.status == 200, answer.body  # its reservations were given back
    finally:
        stuck.close()
