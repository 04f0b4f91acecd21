"""Follow-up turns with and without ``placement.skip_prefill_share`` (docs/behaviour.md "Placement").

A consumer holds the prompts it decoded and publishes them in its KV-cache events; a follow-up
turn whose prompt it holds past the share is decoded there alone, its producer prefill skipped.
This runs conversations through two routers over one fake fleet (2 producers and 2 consumers,
every engine publishing KV events, a prefill cost per uncached token so skipping it shows): one
with the default share (0.9), one with ``0`` (never). Each conversation: a ~4,000-character
system prompt and ``--turns`` turns, each appending the last answer and a short question, one
conversation at a time (c=1), one router after the other. Figures: follow-up turns' time to first
byte, p50 and p99; the producers' prefills (the fakes' own counters, before and after); the
worker's CPU per turn.

``--no-events``: the fakes publish nothing, so what a consumer holds is learned from the router's
own traffic (the prompt it decoded and the answer it wrote). ``--answer-tokens N``: each turn's
answer is the one the consumer wrote (N tokens, read from the stream and sent back in the next
turn), not a fixed short line; a long answer is what a consumer's learned holdings must know of.

Usage: ``python -m perf.multiturn [--conversations 30] [--turns 4] [--us-per-token 50] [--no-events]
[--answer-tokens 8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from typing import Any

import aiohttp
import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles, write_config
from perf.token_ids import cpu_ns

MODEL = "fake-model"
PRODUCERS = ["mp0", "mp1"]
CONSUMERS = ["md0", "md1"]


def _router(fleet: FakeFleet, tmp: str, share: float) -> RouterProcess:
    engines = [{"name": n, "role": "producer", "url": fleet.engines[n]} for n in PRODUCERS]
    engines += [{"name": n, "role": "consumer", "url": fleet.engines[n]} for n in CONSUMERS]
    conf = {"server": {"workers": 1}, "preflight": {"on_start": False},
            "log": {"access_log": "", "level": "warning"},
            "placement": {"skip_prefill_share": share, "load_interval_s": 0.1}}
    return RouterProcess.start(write_config(engines, conf), log_path=os.path.join(tmp, f"router-{share}.log"),
                               workers=1)


async def _turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                answer_tokens: int) -> tuple[float, str]:
    """One streamed turn: seconds to its first body byte, and the answer to send back (the one
    written when ``answer_tokens`` > 8, else a fixed short line)."""
    body: dict[str, object] = {"model": MODEL, "messages": messages, "max_tokens": answer_tokens, "stream": True}
    start = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.read()
        first = await resp.content.readany()
        ttfb = time.perf_counter() - start
        data = first + await resp.read()
    if answer_tokens <= 8:
        return ttfb, "an answer of a few words"
    pieces = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or ():
                pieces.append((choice.get("delta") or {}).get("content") or "")
    return ttfb, "".join(pieces)


async def _conversations(routers: dict[str, RouterProcess], count: int, turns: int,
                         answer_tokens: int) -> dict[str, list[float]]:
    follow_ups: dict[str, list[float]] = {name: [] for name in routers}
    async with aiohttp.ClientSession() as session:
        for c in range(count):
            system = f"conversation {uuid.uuid4().hex}: " + "".join(
                f"house rule {k}: answer plainly and briefly. " for k in range(100))[:4000]
            history = {name: [{"role": "system", "content": system}] for name in routers}
            for turn in range(turns):
                for name, router in routers.items():
                    history[name].append({"role": "user", "content": f"question {turn} of conversation {c}?"})
                    ttfb, answer = await _turn(session, router.url, history[name], answer_tokens)
                    history[name].append({"role": "assistant", "content": answer})
                    if turn:
                        follow_ups[name].append(ttfb)
                    await asyncio.sleep(0.15)  # the consumer's events reach the supervisor, then the workers
    return follow_ups


def _prefills(fleet: FakeFleet) -> int:
    return sum(fleet.stats(n)["requests"]["prefill"] for n in PRODUCERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--us-per-token", type=int, default=50, help="the fakes' prefill cost per uncached token")
    parser.add_argument("--no-events", action="store_true", help="the fakes publish no KV events: holdings learned")
    parser.add_argument("--answer-tokens", type=int, default=8, help="answer tokens (past 8: sent back as written)")
    args = parser.parse_args()
    events = ["--prefix-cache"] if args.no_events else ["--kv-events"]  # a cache either way
    fleet = FakeFleet.start(PRODUCERS + CONSUMERS, args=[
        "--model", MODEL, *events, "--lease-s", "60", "--prefill-us-per-token", str(args.us_per_token)])
    tmp = tempfile.mkdtemp(prefix="narwhal-multiturn-")
    routers: dict[str, RouterProcess] = {}
    try:
        routers = {"skip_prefill_share 0.9": _router(fleet, tmp, 0.9),
                   "skip_prefill_share 0 (off)": _router(fleet, tmp, 0.0)}
        results: dict[str, Any] = {}
        for name in routers:  # each alone, so the producers' counters are its own
            start = _prefills(fleet)
            workers = router_roles(routers[name].proc.pid)["worker"]
            cpu = cpu_ns(workers)
            follow = asyncio.run(_conversations({name: routers[name]}, args.conversations, args.turns,
                                                args.answer_tokens))[name]
            per_turn = (cpu_ns(workers) - cpu) / (args.conversations * args.turns) / 1e3
            results[name] = (follow, _prefills(fleet) - start, per_turn)
    finally:
        for router in routers.values():
            router.stop()
        fleet.stop()
    print(f"{args.conversations} conversations × {args.turns} turns, ~4,000-character system prompt, "
          f"{args.us_per_token} µs per uncached prompt token on the producers, c=1, one worker, "
          f"KV events {'off' if args.no_events else 'on'}, answers of {args.answer_tokens} tokens")
    print(f"{'router':<28}{'follow-up TTFB p50 ms':>24}{'p99 ms':>10}{'producer prefills':>20}"
          f"{'worker CPU µs/turn':>20}")
    for name, (follow, prefills, per_turn) in results.items():
        p99 = statistics.quantiles(follow, n=100)[98] if len(follow) > 1 else follow[0]
        print(f"{name:<28}{statistics.median(follow) * 1e3:>24.2f}{p99 * 1e3:>10.2f}{prefills:>20}"
              f"{per_turn:>20.0f}")


if __name__ == "__main__":
    main()
