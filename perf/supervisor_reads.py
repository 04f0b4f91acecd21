"""The supervisor's load reads one at a time: CPU and Python calls per ``/metrics`` read.

Why: every ``placement.load_interval_s`` (0.1 s) the supervisor reads every placeable engine's
``/metrics`` (docs/behaviour.md "Placement"), so at 32 engines it makes 320 reads a second, most of its idle cost.
This runs the real ``LoadReader._read`` (the pooled HTTP/1.1 exchange, the parse, the load record
written to a real shared region) back to back against a small aiohttp server in its own process
answering the series placement reads, padded with histogram lines to ``--body-kib`` (a real
engine's answer is tens of KiB, mostly histograms), and reads this process's CPU from
``/proc/self/task/*/schedstat``; then it counts the Python calls of a read with ``cProfile``, a
figure the host's load does not move.
``--baseline REF[,REF…]`` runs each REF's ``narwhal/`` (exported, ``perf.baseline``) the same
way in a subprocess, interleaved with this checkout's; figures are medians over the rounds.

Usage: ``python -m perf.supervisor_reads [--reads 2000] [--rounds 3] [--body-kib 0,40] [--baseline REF]``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from perf import baseline
from perf.load import procs

CALL_READS = 200
# A histogram's lines as vLLM writes them: what a real /metrics is mostly made of.
_PAD = 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="%d.0",model_name="meta-llama/Llama-3.1-8B"} 512.0\n'


# The series the reader wants, as vLLM 0.11 writes them, then histogram lines up to the size asked.
_HEAD = (
    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
    '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048"} 1.0\n'
)


def _body(kib: int) -> bytes:
    """What the server answers: the wanted series, padded with histogram lines to ``kib`` KiB."""
    lines, size, i = [_HEAD], len(_HEAD), 0
    while size < kib * 1024:
        lines.append(_PAD % i)
        size, i = size + len(lines[-1]), i + 1
    return "".join(lines).encode()


def _serve(port: int, body: bytes) -> None:
    """``GET /metrics`` answered with ``body``, keep-alive, until terminated: the engine's side."""
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the /metrics server on port {port} did not start")


async def _reads(url: str, count: int) -> tuple[float, float]:
    """``count`` reads of the engine at ``url``: µs of CPU per read, then Python calls per read."""
    from narwhal.engines.control import PooledReader
    from narwhal.fleet import Fleet
    from narwhal.settings import Settings
    from narwhal.shm.shared import SharedFleet
    from narwhal.supervisor.load import LoadReader

    settings = Settings.model_validate({"engines": [{"name": "p0", "url": url, "role": "producer"}]})
    shared = SharedFleet.create(engines=4, slots=8)
    shared.assign_engines([("p0", url)])
    shared.claim_slot(os.getpid())
    shared.claim_slot(1)  # a second worker (pid 1 lives), as with server.workers = 2
    reader = LoadReader(shared, PooledReader(settings.engine, 1.0))
    engine: Any = Fleet(settings).engines[0]
    # The record written as the loop writes it (a baseline before the loop published wrote it in the read).
    take, publish = getattr(reader, "take", list), getattr(shared, "publish_loads", lambda readings: None)

    async def read() -> None:
        await reader._read(engine)
        publish(take())

    for _ in range(100):  # the connection, the caches
        await read()
    start = procs.self_cpu_ns()
    for _ in range(count):
        await read()
    cpu_us = (procs.self_cpu_ns() - start) / 1e3 / count
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALL_READS):
        await read()
    profile.disable()
    return cpu_us, sum(entry.callcount for entry in profile.getstats()) / CALL_READS


def _measure(root: str | None, url: str, count: int) -> tuple[float, float]:
    """``count`` reads of ``url`` in a fresh process: this checkout's ``narwhal`` or the tree at ``root``."""
    return baseline.child_figures("perf.supervisor_reads", root, [url, str(count)], 300)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.supervisor_reads", description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=2000, help="reads per measurement (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--body-kib", default="0,40", help="padding of the fake's answer, KiB, comma-separated")
    parser.add_argument("--baseline", help="git commits to measure beside this checkout, comma-separated")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import uvloop

        print(*uvloop.run(_reads(args.child[0], int(args.child[1]))))
        return 0
    if args.serve:
        _serve(int(args.serve[0]), _body(int(args.serve[1])))
        return 0
    targets = baseline.targets_or_exit(args.baseline, "perf.supervisor_reads")
    print("| body | target | µs CPU per read, median | rounds | Python calls per read |\n|---|---|---:|---|---:|")
    for kib in [int(k) for k in args.body_kib.split(",") if k.strip()]:
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "perf.supervisor_reads", "--serve", str(port), str(kib)],
                                  cwd=baseline.REPO)
        try:
            _wait_listening(port)
            figures = baseline.interleaved(targets, args.rounds, functools.partial(
                _measure, url=f"http://127.0.0.1:{port}", count=args.reads))
            for name, values in figures.items():
                cpu = [v[0] for v in values]
                print(f"| {len(_body(kib)) // 1024} KiB | {name} | {statistics.median(cpu):.1f} "
                      f"| {', '.join(f'{v:.1f}' for v in cpu)} | {statistics.median(v[1] for v in values):.0f} |",
                      flush=True)
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
