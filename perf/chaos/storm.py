"""Poison storm: faults that follow requests must not take the fleet away from clean ones.

Why (docs/behaviour.md "Recovery"): a prompt that makes every engine fail charges a failure — and with
``recovery.failure_quarantine_s`` a quarantine — to whichever engine serves it. When such
requests are frequent, every engine of a role is quarantined nearly all the time; if placement
treated quarantine like ejection, clean requests would be answered 503 ``no_engine`` although
every engine is healthy. The contract: quarantine steers traffic away only while others can take
it, and ``max_ejected_fraction`` below 1 bounds ejections the same way.

The scenario: a fresh fake fleet (2 producers, 2 consumers) and the router under gunicorn with
``failure_quarantine_s = 1``, ``max_retries = 1``, ``eject_after = 3`` and
``max_ejected_fraction`` (default 0.5). After a clean warm-up, the storm sends for ``storm_s``
seconds from ``storm_concurrency`` clients, half of the requests poisoned
(:func:`perf.chaos.faults.poison_expectation`). Every reply is judged against the contract like
the main suite's; the figure is ``clean_success_share``: the clean requests of the storm answered
with their full stream. Below :data:`MIN_CLEAN_SHARE` the run fails — when
``max_ejected_fraction < 1`` only: at 1.0 ejections may legitimately take a whole role, and the
figure is reported, not judged. The storm kills no worker, so no request is excused. Afterwards
every engine must be admitted again, 40 clean requests must succeed, no reservation may be held
and no KV handoff stranded.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections import Counter
from typing import Any

import aiohttp

from perf.chaos import checks
from perf.chaos.driver import Chaos
from perf.chaos.faults import (
    ADMIN_TOKEN,
    CLIENT_SLACK_S,
    CONSUMERS,
    DEADLINE_S,
    NO_ENGINE_BACKOFF_S,
    PRODUCERS,
    Result,
    clean_expectation,
    poison_expectation,
)

POISON_SHARE = 0.5
MIN_CLEAN_SHARE = 0.99
# Fewer clean requests than this cannot tell 99 % from 98 %: the run is too small to judge.
MIN_CLEAN_REQUESTS = 200
STORM_RECOVERY: dict[str, Any] = {"failure_quarantine_s": 1.0, "max_retries": 1, "eject_after": 3}
_OUT = {"ejected", "probing"}


async def drive(chaos: Chaos, seconds: float, concurrency: int, poison_share: float,
                rng: random.Random) -> tuple[list[Result], float, float]:
    """``concurrency`` clients send for ``seconds``, a ``poison_share`` of the requests poisoned;
    returns the results and the storm's (monotonic) start and end."""
    results: list[Result] = []
    ids = itertools.count()
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S + CLIENT_SLACK_S)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        stop = asyncio.Event()
        monitor = asyncio.create_task(chaos.monitor(session, stop))
        start = time.monotonic()
        until = start + seconds

        async def client() -> None:
            while time.monotonic() < until:
                exp = poison_expectation(rng) if rng.random() < poison_share else clean_expectation(rng)
                res = await chaos.one(session, next(ids), exp, rng.random() < 0.3)
                results.append(res)
                if res.outcome == "http:503:no_engine":
                    await asyncio.sleep(NO_ENGINE_BACKOFF_S)  # clients honour Retry-After

        await asyncio.gather(*(client() for _ in range(concurrency)))
        end = time.monotonic()
        stop.set()
        await monitor
    return results, start, end


def role_shares(samples: list[tuple[float, dict[str, str]]], start: float, end: float) -> dict[str, Any]:
    """Of the breaker samples taken during the storm, the share in which a whole role was out
    (ejected or probing), and in which it was out or quarantined (placement's fallback served)."""
    during = [states for t, states in samples if start <= t <= end]
    shares: dict[str, Any] = {"samples": len(during)}
    for role, names in (("producer", PRODUCERS), ("consumer", CONSUMERS)):
        out = sum(all(s.get(n) in _OUT for n in names) for s in during)
        held = sum(all(s.get(n) in _OUT | {"quarantined"} for n in names) for s in during)
        shares[role] = {"all_out": round(out / max(len(during), 1), 3),
                        "all_out_or_quarantined": round(held / max(len(during), 1), 3)}
    return shares


def summarize(results: list[Result], fraction: float) -> dict[str, Any]:
    clean = [r for r in results if r.kind == "none"]
    poisoned = [r for r in results if r.kind != "none"]
    ok = sum(r.verdict == "ok" for r in clean)
    return {
        "requests": len(results),
        "clean": len(clean),
        "clean_ok": ok,
        "clean_success_share": round(ok / len(clean), 4) if clean else 0.0,
        "clean_failures": dict(Counter(r.outcome for r in clean if r.verdict != "ok")),
        "poisoned": len(poisoned),
        "poisoned_outcomes": dict(Counter(r.outcome for r in poisoned)),
        "violations": sum(r.verdict == "violation" for r in results),
        "violation_samples": [vars(r) for r in results if r.verdict == "violation"][:10],
        "enforced": fraction < 1.0,
    }


def after_checks(chaos: Chaos) -> tuple[list[str], dict[str, Any]]:
    """With the storm over: every engine back, service restored, nothing held or stranded."""
    assert chaos.router is not None and chaos.fleet is not None
    url, fleet, leaks = chaos.router.url, chaos.fleet, []
    if not checks.wait_for(lambda: all(e["state"] == "admitted" for e in checks.admin_engines(url, ADMIN_TOKEN)), 20):
        states = ", ".join(f"{e['name']}={e['state']}" for e in checks.admin_engines(url, ADMIN_TOKEN))
        leaks.append("engines not admitted after the storm: " + states)
    after = asyncio.run(chaos.drive(40, 4, tracks=False, faults=0.0))
    bad = [f"#{r.idx} {r.outcome} {r.problem}" for r in after if r.outcome != "ok"]
    if bad:
        leaks.append(f"{len(bad)} of {len(after)} clean requests failed after the storm: {bad[:3]}")
    idle = {"prefill": 0, "decode": 0}
    if not checks.wait_for(lambda: all(e["inflight"] == idle for e in checks.admin_engines(url, ADMIN_TOKEN)), 10):
        leaks.append("reservations still held after the storm")
    checks.wait_for(lambda: sum(fleet.stats(p)["held_requests"] for p in PRODUCERS) == 0, 3)
    kv = checks.kv_accounting(fleet, PRODUCERS, CONSUMERS, [], {})
    leaks += [f"storm: {line}" for line in checks.kv_leaks(kv)]
    return leaks, kv


def run_storm(chaos: Chaos, fraction: float, seconds: float, concurrency: int) -> dict[str, Any]:
    """The whole scenario on ``chaos`` (not started yet); always stops what it started."""
    out = os.path.join(chaos.args.out, f"storm-{fraction:g}")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(chaos.args.seed + 2)  # the storm's own stream: the main suite's stays as it was
    rep: dict[str, Any] = {"max_ejected_fraction": fraction, "storm_s": seconds, "concurrency": concurrency,
                           "poison_share": POISON_SHARE, **{f"recovery.{k}": v for k, v in STORM_RECOVERY.items()}}
    try:
        chaos.start(recovery={**STORM_RECOVERY, "max_ejected_fraction": fraction}, out=out)
        warm, _, _ = asyncio.run(drive(chaos, 1.0, concurrency, 0.0, rng))
        rep["warmup_failures"] = [f"{r.outcome} {r.problem}" for r in warm if r.verdict != "ok"][:5]
        results, start, end = asyncio.run(drive(chaos, seconds, concurrency, POISON_SHARE, rng))
        rep["duration_s"] = round(end - start, 1)
        rep.update(summarize(results, fraction))
        rep["req_per_s"] = round(len(results) / max(end - start, 1e-9), 1)
        rep["roles"] = role_shares(chaos.samples, start, end)
        rep["leaks"], rep["kv"] = after_checks(chaos)
    finally:
        chaos.stop()
    rep["failed"] = verdict(rep)
    return rep


def verdict(rep: dict[str, Any]) -> list[str]:
    """Why the storm run fails (empty: it passed)."""
    failed = list(rep["leaks"])
    if rep["warmup_failures"]:
        failed.append(f"clean warm-up requests failed: {rep['warmup_failures']}")
    if rep["violations"]:
        failed.append(f"{rep['violations']} replies outside the contract")
    if rep["enforced"] and rep["clean"] < MIN_CLEAN_REQUESTS:
        failed.append(f"only {rep['clean']} clean requests in the storm (< {MIN_CLEAN_REQUESTS}): too few to judge")
    if rep["enforced"] and rep["clean_success_share"] < MIN_CLEAN_SHARE:
        failed.append(f"clean_success_share {rep['clean_success_share']} < {MIN_CLEAN_SHARE}")
    return failed
