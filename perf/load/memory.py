"""Router memory per open stream: RSS/PSS of all router processes idle vs with N slow streams open.

Why "open at the peak sample" and not N: on a small host opening 1,000 streams (each a prefill
plus a decode through the router) takes a while, so memory is sampled continuously and the
growth is divided by the number of streams that were really open (first token received, not yet
finished) at the sample where most were open. The streams are paced by the fake consumer
(``token_delay_s``) so they stay open several seconds, long enough for all to be in flight at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from perf.load import procs
from perf.load.generator import COMPLETIONS, HEADERS, Workload, new_session, percentile, run_round
from perf.load.reading import error_key
from perf.load.stack import Target

BATCH = 100  # connects per batch while opening streams: no SYN storm on the listen backlog
BATCH_PAUSE_S = 0.05
SAMPLE_EVERY_S = 0.2


@dataclass(slots=True)
class _Tally:
    """What the slow streams report while they run: how many are open now, their TTFBs and errors."""

    errors: Counter[str]
    open: int = 0
    max_open: int = 0
    ttfb: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Peak:
    """The memory sample taken with the most streams open (at equal counts, the larger RSS)."""

    open: int
    mem: procs.Memory


async def _slow_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float, tally: _Tally
) -> None:
    start = time.perf_counter()
    opened = False
    errors = tally.errors
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=body, headers=HEADERS) as resp:
                if resp.status != 200:
                    errors[error_key(resp.status, await resp.read())] += 1
                    return
                tail = b""
                async for chunk in resp.content.iter_any():
                    if not opened:
                        opened = True
                        tally.open += 1
                        tally.max_open = max(tally.max_open, tally.open)
                        tally.ttfb.append(time.perf_counter() - start)
                    tail = (tail + chunk)[-64:]
                if b"[DONE]" not in tail:
                    errors["incomplete_stream"] += 1
    except TimeoutError:
        errors["timeout"] += 1
    except (aiohttp.ClientError, OSError) as exc:
        errors[type(exc).__name__] += 1
    finally:
        if opened:
            tally.open -= 1


def _sample(target: Target) -> procs.Memory:
    return procs.memory(target.pids)


def _mean(samples: list[procs.Memory]) -> procs.Memory:
    n = len(samples) or 1
    return procs.Memory(
        sum(s.rss_kib for s in samples) // n,
        sum(s.pss_kib for s in samples) // n,
        max((s.processes for s in samples), default=0),
    )


async def run_memory(
    target: Target, streams: int, *, token_delay_s: float, tokens: int, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Idle memory, memory with ``streams`` slow streams open, and memory after they ended."""
    session = new_session()
    try:
        warm_errors, idle = await _idle(session, target, streams)
        body = Workload(stream=True, tokens=tokens, fault={"decode": {"token_delay_s": token_delay_s}}).body()
        tally = _Tally(warm_errors)
        peak = _Peak(0, idle)
        started = time.perf_counter()
        await _hold_streams(session, target, body, streams, timeout_s, tally, peak)
        elapsed = time.perf_counter() - started
        await asyncio.sleep(1.0)
        after = _sample(target)
    finally:
        await session.close()

    def per_stream(a: int, b: int) -> float | None:
        return round((a - b) / peak.open, 2) if peak.open else None

    return {
        "target": target.name,
        "kind": target.kind,
        "streams": streams,
        "stream_s": round(tokens * token_delay_s, 2),
        "open_at_peak": peak.open,
        "max_open": tally.max_open,
        "elapsed_s": round(elapsed, 2),
        "errors": {"count": sum(tally.errors.values()), "by_status": dict(sorted(tally.errors.items()))},
        "ttfb_ms": {
            "p50": _ms(percentile(tally.ttfb, 50)),
            "p99": _ms(percentile(tally.ttfb, 99)),
        },
        "idle": asdict(idle),
        "peak": asdict(peak.mem),
        "after": asdict(after),
        "rss_growth_kib_per_stream": per_stream(peak.mem.rss_kib, idle.rss_kib),
        "pss_growth_kib_per_stream": per_stream(peak.mem.pss_kib, idle.pss_kib),
        "detail": dict(target.detail),
    }


async def _idle(session: aiohttp.ClientSession, target: Target, streams: int) -> tuple[Counter[str], procs.Memory]:
    """The warm-up's errors (kept, prefixed) and the mean of three idle samples after it."""
    # Warm the router's code paths and pools first: idle means "has served", not "fresh".
    warm = await run_round(session, target.name, target.url, Workload(), min(32, streams), 0.5, 0.2, {})
    await asyncio.sleep(1.0)
    idle_samples = []
    for _ in range(3):
        idle_samples.append(_sample(target))
        await asyncio.sleep(0.1)
    return Counter({f"warmup:{k}": v for k, v in warm.errors.items()}), _mean(idle_samples)


async def _hold_streams(
    session: aiohttp.ClientSession,
    target: Target,
    body: bytes,
    streams: int,
    timeout_s: float,
    tally: _Tally,
    peak: _Peak,
) -> None:
    """Open ``streams`` slow streams in batches and wait for them to end, sampling memory all along."""
    url = target.url + COMPLETIONS
    tasks: list[asyncio.Task[None]] = []
    watcher = asyncio.ensure_future(_watch_peak(target, tally, peak))
    try:
        for i in range(0, streams, BATCH):
            for _ in range(min(BATCH, streams - i)):
                tasks.append(asyncio.ensure_future(_slow_stream(session, url, body, timeout_s, tally)))
            await asyncio.sleep(BATCH_PAUSE_S)
        await asyncio.gather(*tasks)
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(watcher, *tasks, return_exceptions=True)


async def _watch_peak(target: Target, tally: _Tally, peak: _Peak) -> None:
    while True:
        open_now = tally.open
        mem = _sample(target)
        if open_now > peak.open or (open_now == peak.open and mem.rss_kib > peak.mem.rss_kib):
            peak.open, peak.mem = open_now, mem
        await asyncio.sleep(SAMPLE_EVERY_S)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)
