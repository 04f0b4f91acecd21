"""The pause a migration adds to a stream, p50 and p99, under load (docs/behaviour.md "Migration").

A migration costs one prefill of the prompt plus the output so far, a handoff and a new
decode's first token: the client sees a longer gap at the cut. This measures that gap.

How: one fake-engine process with a producer and two consumers, the router under real gunicorn
(2 workers, its defaults, ``max_migrations = 1``), and ``--concurrency`` clients sending paced
streams (``--tokens`` tokens, one every ``--token-ms``) for ``--seconds``. Each stream carries a
per-request fault that closes it after a drawn number of tokens on its first consumer; the fake
continues output exactly (``fake_engine.continuation``), so the client reads one stream. Per
stream the client takes the arrival time of every token event and reports the gap at the cut
(the token before it to the one after it) against the stream's median gap elsewhere. Every
stream must come back whole (every token once, ``[DONE]``): one that does not is counted and
fails the run.

The fake engines' prefill is instant: the figure is the router's share of the stall (a new
placement, prefill leg, handoff check and decode connect) plus one token interval; on real
engines add the prefill of the prompt and the output so far (a prefix-cache hit for the
prompt's part on a producer that holds it, which placement prefers).

Usage: ``python -m perf.migration_stall [--concurrency 64] [--seconds 10] [--tokens 48]
[--token-ms 10]``. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import aiohttp
import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config

MODEL = "fake-model"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(session: aiohttp.ClientSession, url: str, tokens: int, token_s: float, cut: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": f"stall {random.random()} " + "w " * 64, "max_tokens": tokens, "stream": True,
            "narwhal_fake": {"decode": {"close_after": cut, "token_delay_s": token_s}}}
    arrivals: list[float] = []
    text: list[str] = []
    done = False
    async with session.post(url + "/v1/completions", json=body) as resp:
        buf = b""
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b"{") and b'"error"' not in data:
                    piece = orjson.loads(data)["choices"][0]["text"]
                    if piece:
                        text.append(piece)
                        arrivals.append(now)
    whole = done and "".join(text) == "".join(f" t{i}" for i in range(tokens))
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    stall = gaps[cut - 1] if whole and len(gaps) >= cut else None
    usual = statistics.median(g for i, g in enumerate(gaps) if i != cut - 1) if whole and len(gaps) > 1 else None
    return {"whole": whole, "stall": stall, "usual": usual}


async def _load(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    rng = random.Random(1)
    until = time.monotonic() + args.seconds
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client() -> None:
            while time.monotonic() < until:
                cut = rng.randint(2, args.tokens - 2)
                results.append(await _one(session, url, args.tokens, args.token_ms / 1000, cut))

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.migration_stall", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--token-ms", type=float, default=10.0)
    args = p.parse_args(argv)
    fleet = FakeFleet.start(["p0", "d0", "d1"], args=["--model", MODEL])
    run = tempfile.mkdtemp(prefix="stall-")
    engines = [{"name": "p0", "role": "producer", "url": fleet.engines["p0"]},
               {"name": "d0", "role": "consumer", "url": fleet.engines["d0"]},
               {"name": "d1", "role": "consumer", "url": fleet.engines["d1"]}]
    sections: dict[str, dict[str, Any]] = {"server": {"workers": 2}, "preflight": {"on_start": False},
                "log": {"access_log": "", "level": "warning"},
                # Every stream migrates: the budget must carry them all, and the faults are the
                # requests', not the engines' (no breaker should take a consumer out).
                "recovery": {"max_migrations": 1, "retry_budget_ratio": 1.0, "eject_after": 1_000_000}}
    router = RouterProcess.start(write_config(engines, sections), workers=2, log_path=f"{run}/router.log")
    try:
        results = asyncio.run(_load(router.url, args))
    finally:
        router.stop()
        fleet.stop()
    stalls = [r["stall"] * 1000 for r in results if r["stall"] is not None]
    usual = [r["usual"] * 1000 for r in results if r["usual"] is not None]
    broken = sum(not r["whole"] for r in results)
    print(f"migration stall, c={args.concurrency}, {args.tokens} tokens {args.token_ms:g} ms apart, "
          f"{args.seconds:g} s: {len(results)} streams, {broken} not whole")
    print("| gap | p50 ms | p99 ms |\n|---|---:|---:|")
    print(f"| at the cut (the migration) | {_pct(stalls, 0.5):.1f} | {_pct(stalls, 0.99):.1f} |")
    print(f"| elsewhere (the stream's median gap) | {_pct(usual, 0.5):.1f} | {_pct(usual, 0.99):.1f} |")
    return 1 if broken or not stalls else 0


if __name__ == "__main__":
    sys.exit(main())
