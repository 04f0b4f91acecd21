"""Client connections are spread over the workers (narwhal.worker.accept), through real gunicorn.

Without it, a burst of connections opened together lands on whichever worker wakes first
(uvloop accepts every pending connection at once), and keep-alive keeps it there.
"""

from __future__ import annotations

import asyncio
import collections
import socket

import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess

BURST = 16


def _health_pid(sock: socket.socket) -> int:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(lengths[0])
    while len(body) < length:
        body += sock.recv(65536)
    return int(orjson.loads(body)["worker"])


async def _burst(url: str, count: int) -> list[int]:
    """Open ``count`` connections at once (all SYNs before any request), then ask each
    which worker holds it."""
    host, port = url.removeprefix("http://").split(":")
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    for s in socks:
        s.setblocking(False)
        try:
            s.connect((host, int(port)))
        except BlockingIOError:
            pass
    try:
        loop = asyncio.get_running_loop()
        for s in socks:
            s.setblocking(True)
            s.settimeout(10)
        return await loop.run_in_executor(None, lambda: [_health_pid(s) for s in socks])
    finally:
        for s in socks:
            s.close()


async def test_a_burst_of_connections_is_spread_over_the_workers(router: RouterProcess, fleet: FakeFleet) -> None:
    pids = await _burst(router.url, BURST)
    per_worker = collections.Counter(pids)
    assert len(per_worker) == 2, per_worker  # the router fixture runs 2 workers
    # Balanced within a few (a worker this far ahead slows its accepts; see narwhal.worker.accept);
    # before, all 16 went to one worker.
    assert min(per_worker.values()) >= BURST // 4, per_worker


