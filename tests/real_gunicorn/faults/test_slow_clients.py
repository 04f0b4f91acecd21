"""Slow clients hold a bounded share of the router's memory, in total (docs/behaviour.md
"Slow clients"; docs/behaviour.md).

Clients that send a stream request and then stop reading leave their streams waiting; each
waiting stream holds its transport buffer and a paused engine connection. With
``server.max_buffered_mib = 1``, only a few may wait at once: the next is cut at once, counted
``narwhal_slow_clients_cut_total{why="buffers_full"}``, while a client that reads is served.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import orjson
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    completion,
    expected_text,
    router_addr,
    scrape,
    send,
    start_router,
    unique_prompt,
    value,
    wait_until,
)

SLOW = 8


@pytest.fixture(scope="module")
def tight(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("tight"),
                        server={"workers": 1, "max_buffered_mib": 1, "client_write_timeout_s": 60})
    yield proc
    proc.stop()


def _slow_client(router: RouterProcess) -> socket.socket:
    """A client asking for a long stream that reads nothing after sending it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(router_addr(router))
    body = orjson.dumps(completion(unique_prompt(), max_tokens=40_000, fake={"decode": {"tokens": 40_000}}))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    return sock


async def test_slow_clients_past_the_workers_budget_are_cut_and_counted(tight: RouterProcess) -> None:
    clients = [_slow_client(tight) for _ in range(SLOW)]
    try:
        wait_until(lambda: value(scrape(tight), "narwhal_slow_clients_cut_total", why="buffers_full") >= 1, 30,
                   "a slow client cut for the worker's buffers")
        reply = await send(tight.url, "/v1/completions", completion(unique_prompt(), max_tokens=4))
        assert reply.status == 200 and reply.text == expected_text(4)  # a client that reads is served
    finally:
        for sock in clients:
            sock.close()
