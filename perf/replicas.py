"""Three router replicas over one fleet, with the engines' KV-cache events and without (docs/behaviour.md
"Placement", docs/decisions.md "KV-cache events").

Each variant starts its own fleet: ``--producers`` producers whose prefix caches hold about
``--prefixes-held`` prefixes each (so they evict), 2 consumers, every engine publishing KV events
and prefilling at ``--us-per-token`` per uncached token; then three routers (one worker each),
with ``placement.kv_events`` on or off. Requests draw a prefix by Zipf's law (``--prefixes``
distinct 3,900-character system prompts, exponent ``--zipf``) plus a question of their own, go
to the replicas in turn, ``--concurrency`` at a time; halfway, one producer restarts (its cache
empty, its event sequence from 0). Figures from the replicas' access logs: the share of prompt
tokens the producers had cached, the prefill predictions judged against them
(``narwhal_holdings_predictions_total`` is per replica; here the access log's own predicted and
reported tokens), and time to first byte p50/p99.

Usage: ``python -m perf.replicas [--requests 600] [--producers 8] [--prefixes 40]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config

MODEL = "fake-model"
PREFIX_CHARS = 3900


def _prefix(i: int, tag: str) -> str:
    text = f"{tag} prefix {i} " + "".join(f"rule {k:03d} of prefix {i}: answer in the house style. " for k in range(90))
    return text[:PREFIX_CHARS]


def _routers(fleet: FakeFleet, producers: list[str], tmp: Path, events: bool) -> list[RouterProcess]:
    engines = [{"name": n, "role": "producer", "url": fleet.engines[n]} for n in producers]
    engines += [{"name": n, "role": "consumer", "url": fleet.engines[n]} for n in ("rd0", "rd1")]
    routers = []
    for i in range(3):
        conf = {"server": {"workers": 1}, "preflight": {"on_start": False},
                "log": {"access_log": str(tmp / f"access-{events}-{i}.log"), "level": "warning"},
                "placement": {"kv_events": events, "skip_prefill_share": 0, "load_interval_s": 0.1}}
        routers.append(RouterProcess.start(write_config(engines, conf), log_path=str(tmp / f"router-{events}-{i}.log"),
                                           workers=1))
    return routers


async def _load(routers: list[RouterProcess], prefixes: list[str], requests: int, concurrency: int, zipf: float,
                restart: Any) -> None:
    weights = [1 / (k + 1) ** zipf for k in range(len(prefixes))]
    rng = random.Random(7)
    order = rng.choices(range(len(prefixes)), weights, k=requests)
    sent = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while sent < requests:
            n = sent
            sent += 1
            if n == requests // 2:
                restart()
            body = {"model": MODEL, "prompt": prefixes[order[n]] + f" question {uuid.uuid4().hex}", "max_tokens": 2}
            async with session.post(routers[n % len(routers)].url + "/v1/completions", json=body) as resp:
                await resp.read()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))


def _figures(tmp: Path, events: bool) -> dict[str, Any]:
    lines = [json.loads(line) for i in range(3) for line in (tmp / f"access-{events}-{i}.log").read_text().splitlines()
             if line.strip()]
    ok = [x for x in lines if x["status"] == 200 and x["prompt_tokens"]]
    prompt = sum(x["prompt_tokens"] for x in ok)
    cached = sum(x["cached_tokens"] or 0 for x in ok)
    predicted = [x for x in ok if x.get("predicted_cached_tokens") is not None]
    exact = sum(1 for x in predicted if x["predicted_cached_tokens"] == (x["cached_tokens"] or 0))
    ttfb = sorted(x["first_byte_s"] for x in ok if x["first_byte_s"] is not None)
    return {"requests": len(lines), "ok": len(ok), "cached_share": cached / prompt if prompt else 0.0,
            "predicted": len(predicted), "exact": exact,
            "ttfb_p50_ms": statistics.median(ttfb) * 1e3, "ttfb_p99_ms": ttfb[int(len(ttfb) * 0.99) - 1] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--prefixes", type=int, default=40)
    parser.add_argument("--prefixes-held", type=int, default=3, help="prefixes each producer's cache holds")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--us-per-token", type=int, default=20)
    args = parser.parse_args()
    producers = [f"rp{i}" for i in range(args.producers)]
    kv_blocks = args.prefixes_held * (PREFIX_CHARS // 64 + 2)  # 16-token blocks of 4 characters a token
    results = {}
    for events in (True, False):
        tmp = Path(tempfile.mkdtemp(prefix="narwhal-replicas-"))
        fleet = FakeFleet.start(producers + ["rd0", "rd1"], args=[
            "--model", MODEL, "--kv-events", "--lease-s", "60", "--kv-blocks", str(kv_blocks),
            "--prefill-us-per-token", str(args.us_per_token)])
        routers: list[RouterProcess] = []
        try:
            routers = _routers(fleet, producers, tmp, events)
            time.sleep(1.0)  # the subscriptions made (events on)
            tag = uuid.uuid4().hex[:8]
            prefixes = [_prefix(i, tag) for i in range(args.prefixes)]

            started = time.monotonic()
            asyncio.run(_load(routers, prefixes, args.requests, args.concurrency, args.zipf,
                              lambda f=fleet: f.control_request("POST", f"/engines/{producers[0]}/start?restart=1")))
            elapsed = time.monotonic() - started
        finally:
            for router in routers:
                router.stop()
            fleet.stop()
        results["events on" if events else "events off"] = {**_figures(tmp, events), "seconds": elapsed}
    print(f"3 replicas, {args.producers} producers holding ~{args.prefixes_held} prefixes each, {args.prefixes} "
          f"prefixes (Zipf {args.zipf}), {args.requests} requests at c={args.concurrency}, "
          f"{producers[0]} restarted halfway")
    print(f"{'variant':<12}{'cached share':>14}{'exact predictions':>20}{'TTFB p50 ms':>13}{'p99 ms':>9}{'s':>7}")
    for name, f in results.items():
        exact = f"{f['exact']}/{f['predicted']}" if f["predicted"] else "—"
        print(f"{name:<12}{f['cached_share']:>14.3f}{exact:>20}{f['ttfb_p50_ms']:>13.2f}{f['ttfb_p99_ms']:>9.2f}"
              f"{f['seconds']:>7.1f}")


if __name__ == "__main__":
    main()
