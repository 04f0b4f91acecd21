"""Hostile connections against the real router (gunicorn, 2 workers): clients that never read,
slowloris bodies, and thousands of idle keep-alive connections.

The property for every request: a 4xx in OpenAI's error shape (with ``x-narwhal-error``) or a
correct 200 — never a 5xx made by the router, never a traceback, and the workers stay alive.
Everything talks to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import time

import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess, children_of
from tests.real_gunicorn.hostile_support import (
    COMPLETIONS,
    IDLE_CONNECTIONS,
    assert_alive,
    read_raw_response,
)
from tests.real_gunicorn.support import (
    MODEL,
    assert_openai_error,
    at_rest,
    http_request,
    router_addr,
    scrape,
    unique_prompt,
    wait_until,
)

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


def _another_is_served(router: RouterProcess, max_tokens: int = 2) -> None:
    """Another client's short completion is answered 200 (within 10 s): the hostile one harms no one."""
    body = orjson.dumps({"model": MODEL, "prompt": unique_prompt(), "max_tokens": max_tokens})
    answer = http_request(router, "POST", COMPLETIONS, body, timeout=10)
    assert answer.status == 200, answer.body


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
            _another_is_served(hostile, max_tokens=3)
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
        _another_is_served(hostile)
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
        _another_is_served(hostile)
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
        _another_is_served(hostile, max_tokens=3)  # its reservations were given back
    finally:
        stuck.close()
