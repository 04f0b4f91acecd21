"""``narwhal workers``: how many gunicorn workers this host needs, measured from an installed router.

The perf suite's worker sweep (``python -m perf --scenarios workers``) lives in the repository,
not in the wheel; an operator sizing a router host has the wheel. This runs the same question
with what the wheel carries: fake engines (one producer and one consumer, each its own process,
as ``narwhal fake-engine`` runs them) and, one after the other, a router under real gunicorn for
each worker count, all on 127.0.0.1; streamed completions of 16 tokens from ``--concurrency``
clients for ``--seconds`` each; then a table of each count's requests per second and router CPU
per request, and the smallest count within 5 % of the best throughput (the perf suite's rule).

Why its own small load loop and not the perf suite's generator: the generator times first
bytes, per-token gaps and latency percentiles across interleaved rounds; sizing needs one
number per count, and the loop is twenty lines of aiohttp.

Invariant: everything it starts it stops (``finally``), and it binds 127.0.0.1 only; its scratch
directory (router logs) goes too, unless a count's router did not start: that is one line naming
its log, and no figure, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles, write_config

MODEL = "sizing-model"
WITHIN = 0.05  # the smallest count whose throughput is within 5 % of the best
BODY = {"model": MODEL, "prompt": "How many workers does this host need?", "max_tokens": 16, "stream": True}


def default_counts(cores: int) -> list[int]:
    """1, 2, 4 … up to 2 × cores (the last step 2 × cores even when not a power of two)."""
    out = [1]
    while out[-1] * 2 <= 2 * cores:
        out.append(out[-1] * 2)
    if out[-1] != 2 * cores:
        out.append(2 * cores)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``narwhal workers``' flags."""
    parser.add_argument("--counts", help="worker counts to try, comma-separated (default: 1, 2, 4 … 2 × cores)")
    parser.add_argument("--seconds", type=float, default=5.0, help="load per count (default 5)")
    parser.add_argument("--concurrency", type=int, default=128, help="concurrent streams (default 128)")


def recommend(rates: dict[int, float]) -> int | None:
    """The smallest count whose requests per second are within :data:`WITHIN` of the best."""
    if not rates:
        return None
    best = max(rates.values())
    return min(n for n, rps in rates.items() if rps >= (1.0 - WITHIN) * best)


def main(args: argparse.Namespace) -> int:
    """Run the sweep and print its table; 0, or 2 for bad flags, 1 when no count could be measured."""
    try:
        counts = ([int(c) for c in args.counts.split(",")] if args.counts
                  else default_counts(os.cpu_count() or 1))
    except ValueError:
        print(f"narwhal workers: --counts must be integers separated by commas, not {args.counts!r}",
              file=sys.stderr)
        return 2
    if not counts or min(counts) < 1 or args.seconds <= 0 or args.concurrency < 1:
        print("narwhal workers: --counts, --seconds and --concurrency must be positive", file=sys.stderr)
        return 2
    print(f"narwhal workers: {', '.join(map(str, counts))} worker(s), {args.seconds:g} s each at "
          f"concurrency {args.concurrency}, fake engines on 127.0.0.1", flush=True)
    scratch = tempfile.mkdtemp(prefix="narwhal-workers-")
    fleet = FakeFleet.start(["sp0", "sd0"], args=["--model", MODEL])
    rates: dict[int, float] = {}
    try:
        engines = [{"name": "sp0", "url": fleet.engines["sp0"], "role": "producer"},
                   {"name": "sd0", "url": fleet.engines["sd0"], "role": "consumer"}]
        for count in counts:
            figures = _measure(engines, count, args.seconds, args.concurrency, scratch)
            if figures is None:
                continue
            rps, cpu_us = figures
            rates[count] = rps
            print(f"  {count:>3} worker(s): {rps:>9.1f} req/s, {cpu_us:>7.0f} µs of router CPU per request",
                  flush=True)
    finally:
        fleet.stop()
        if len(rates) == len(counts):  # a failed count's log stays for the operator to read
            shutil.rmtree(scratch, ignore_errors=True)
    choice = recommend(rates)
    if choice is None:
        print("narwhal workers: no worker count could be measured", file=sys.stderr)
        return 1
    print(f"server.workers = {choice}  (the smallest count within {WITHIN:.0%} of the best throughput here)")
    return 0


def _measure(engines: list[dict[str, str]], workers: int, seconds: float, concurrency: int,
             scratch: str) -> tuple[float, float] | None:
    """One router of ``workers`` under the load: (requests per second, router CPU µs per request)."""
    sections: dict[str, dict[str, object]] = {"server": {"workers": workers}, "preflight": {"on_start": False},
                "log": {"level": "warning", "access_log": ""},
                "placement": {"queue_timeout_s": 30, "max_queue": 100000, "skip_prefill_share": 0}}
    config = write_config(engines, sections)
    try:
        router = RouterProcess.start(config, log_path=str(Path(scratch) / f"router-w{workers}.log"), timeout=60,
                                     workers=workers)
    except (RuntimeError, TimeoutError) as exc:
        log = Path(scratch) / f"router-w{workers}.log"
        print(f"  {workers:>3} worker(s): the router did not start ({exc}); its log: {log}", file=sys.stderr)
        return None
    try:
        pids = [p for pids in router_roles(router.proc.pid).values() for p in pids]  # master, supervisor, workers
        before = _cpu_s(pids)
        done = asyncio.run(_load(router.url, seconds, concurrency))
        used = _cpu_s(pids) - before
    finally:
        router.stop()
        os.unlink(config)
    if not done:
        print(f"  {workers:>3} worker(s): no request completed; its log: {router.log_path}", file=sys.stderr)
        return None
    return done / seconds, used / done * 1e6


async def _load(url: str, seconds: float, concurrency: int) -> int:
    """Streams from ``concurrency`` clients until ``seconds`` pass: how many completed whole (a 200
    read to its end)."""
    done = 0
    end = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < end:
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                await resp.read()
                if resp.status == 200 and time.monotonic() <= end:
                    done += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return done


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc/<pid>/stat``; a gone process counts 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total
