"""Follow-up turns with and without ``placement.skip_prefill_share`` (docs/behaviour.md "Placement").

A consumer holds the prompts it decoded and publishes them in its KV-cache events; a follow-up
turn whose prompt it holds past the share is decoded there alone, its producer prefill skipped.
This runs conversations through two routers over one fake fleet (2 producers and 2 consumers,
every engine publishing KV events, a prefill cost per uncached token so skipping it shows): one
with the default share (0.9), one with ``0`` (never). Each conversation: a ~4,000-character
system prompt and ``--turns`` turns, each appending the last answer and a short question, one
conversation at a time (c=1), one router after the other. Figures: follow-up turns' time to first
byte, p50 and p99; the producers' prefills (the fakes' own counters, before and after).

Usage: ``python -m perf.multiturn [--conversations 30] [--turns 4] [--us-per-token 50]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import uuid
from typing import Any

import aiohttp

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf.token_ids import first_byte

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


async def _turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> tuple[float, str]:
    body: dict[str, object] = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}
    return await first_byte(session, url, body), "an answer of a few words"


async def _conversations(routers: dict[str, RouterProcess], count: int, turns: int) -> dict[str, list[float]]:
    follow_ups: dict[str, list[float]] = {name: [] for name in routers}
    async with aiohttp.ClientSession() as session:
        for c in range(count):
            system = f"conversation {uuid.uuid4().hex}: " + "".join(
                f"house rule {k}: answer plainly and briefly. " for k in range(100))[:4000]
            history = {name: [{"role": "system", "content": system}] for name in routers}
            for turn in range(turns):
                for name, router in routers.items():
                    history[name].append({"role": "user", "content": f"question {turn} of conversation {c}?"})
                    ttfb, answer = await _turn(session, router.url, history[name])
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
    args = parser.parse_args()
    fleet = FakeFleet.start(PRODUCERS + CONSUMERS, args=[
        "--model", MODEL, "--kv-events", "--lease-s", "60", "--prefill-us-per-token", str(args.us_per_token)])
    tmp = tempfile.mkdtemp(prefix="narwhal-multiturn-")
    routers: dict[str, RouterProcess] = {}
    try:
        routers = {"skip_prefill_share 0.9": _router(fleet, tmp, 0.9),
                   "skip_prefill_share 0 (off)": _router(fleet, tmp, 0.0)}
        results: dict[str, Any] = {}
        for name in routers:  # each alone, so the producers' counters are its own
            start = _prefills(fleet)
            follow = asyncio.run(_conversations({name: routers[name]}, args.conversations, args.turns))[name]
            results[name] = (follow, _prefills(fleet) - start)
    finally:
        for router in routers.values():
            router.stop()
        fleet.stop()
    print(f"{args.conversations} conversations × {args.turns} turns, ~4,000-character system prompt, "
          f"{args.us_per_token} µs per uncached prompt token on the producers, c=1, one worker")
    print(f"{'router':<28}{'follow-up TTFB p50 ms':>24}{'p99 ms':>10}{'producer prefills':>20}")
    for name, (follow, prefills) in results.items():
        p99 = statistics.quantiles(follow, n=100)[98] if len(follow) > 1 else follow[0]
        print(f"{name:<28}{statistics.median(follow) * 1e3:>24.2f}{p99 * 1e3:>10.2f}{prefills:>20}")


if __name__ == "__main__":
    main()
