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
from dataclasses import asdict
from typing import Any

import aiohttp

from perf import procs
from perf.load import COMPLETIONS, HEADERS, Workload, new_session, percentile, run_round
from perf.stack import Target

BATCH = 100  # connects per batch while opening streams: no SYN storm on the listen backlog
BATCH_PAUSE_S = 0.05
SAMPLE_EVERY_S = 0.2


async def _slow_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    timeout_s: float,
    state: dict[str, int],
    ttfb: list[float],
    errors: Counter[str],
) -> None:
    start = time.perf_counter()
    opened = False
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=body, headers=HEADERS) as resp:
                if resp.status != 200:
                    await resp.read()
                    errors[str(resp.status)] += 1
                    return
                tail = b""
                async for chunk in resp.content.iter_any():
                    if not opened:
                        opened = True
                        state["open"] += 1
                        state["max_open"] = max(state["max_open"], state["open"])
                        ttfb.append(time.perf_counter() - start)
                    tail = (tail + chunk)[-64:]
                if b"[DONE]" not in tail:
                    errors["incomplete_stream"] += 1
    except TimeoutError:
        errors["timeout"] += 1
    except (aiohttp.ClientError, OSError) as exc:
        errors[type(exc).__name__] += 1
    finally:
        if opened:
            state["open"] -= 1


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
        # Warm the router's code paths and pools first: idle means "has served", not "fresh".
        warm = await run_round(session, target.name, target.url, Workload(), min(32, streams), 0.5, 0.2, {})
        await asyncio.sleep(1.0)
        idle_samples = []
        for _ in range(3):
            idle_samples.append(_sample(target))
            await asyncio.sleep(0.1)
        idle = _mean(idle_samples)

        body = Workload(stream=True, tokens=tokens, fault={"decode": {"token_delay_s": token_delay_s}}).body()
        state = {"open": 0, "max_open": 0}
        ttfb: list[float] = []
        errors: Counter[str] = Counter({f"warmup:{k}": v for k, v in warm.errors.items()})
        url = target.url + COMPLETIONS
        tasks: list[asyncio.Task[None]] = []
        peak_open, peak = 0, idle
        started = time.perf_counter()

        async def sampler() -> None:
            nonlocal peak_open, peak
            while True:
                open_now = state["open"]
                mem = _sample(target)
                if open_now > peak_open or (open_now == peak_open and mem.rss_kib > peak.rss_kib):
                    peak_open, peak = open_now, mem
                await asyncio.sleep(SAMPLE_EVERY_S)

        watcher = asyncio.ensure_future(sampler())
        try:
            for i in range(0, streams, BATCH):
                for _ in range(min(BATCH, streams - i)):
                    tasks.append(
                        asyncio.ensure_future(_slow_stream(session, url, body, timeout_s, state, ttfb, errors))
                    )
                await asyncio.sleep(BATCH_PAUSE_S)
            await asyncio.gather(*tasks)
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(watcher, *tasks, return_exceptions=True)
        elapsed = time.perf_counter() - started
        await asyncio.sleep(1.0)
        after = _sample(target)
    finally:
        await session.close()

    def per_stream(a: int, b: int) -> float | None:
        return round((a - b) / peak_open, 2) if peak_open else None

    return {
        "target": target.name,
        "kind": target.kind,
        "streams": streams,
        "stream_s": round(tokens * token_delay_s, 2),
        "open_at_peak": peak_open,
        "max_open": state["max_open"],
        "elapsed_s": round(elapsed, 2),
        "errors": {"count": sum(errors.values()), "by_status": dict(sorted(errors.items()))},
        "ttfb_ms": {
            "p50": _ms(percentile(ttfb, 50)),
            "p99": _ms(percentile(ttfb, 99)),
        },
        "idle": asdict(idle),
        "peak": asdict(peak),
        "after": asdict(after),
        "rss_growth_kib_per_stream": per_stream(peak.rss_kib, idle.rss_kib),
        "pss_growth_kib_per_stream": per_stream(peak.pss_kib, idle.pss_kib),
        "detail": dict(target.detail),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)
