"""The soak: the fault mix for as long as asked, and nothing may grow (perf/CHAOS.md "Soak").

The main suite proves every reply right over a few thousand requests; a soak proves the router
does not slowly leak under the same mix for half an hour. ``--concurrency`` clients (256 for
the record in perf/RESULTS.md) send for ``--soak-minutes``; 30 % of the requests carry a
per-request fault of the catalogue; every :data:`EVENT_EVERY_S` the next engine or process
fault fires in turn (engines stopped, health flapping, KV reads failing, a worker and the
supervisor killed, a reload). Every reply is judged as in the main suite. Each minute the
router's processes (fds, RSS, per role) and the producers' held KV blocks are sampled. At the
end, with faults cleared and the fakes' lease run out, every producer must hold nothing, and
each role's fds and RSS must be back within the main suite's bounds of their first sample.

Unlike the main suite it keeps no record per request (counts and the first violations only), and
its KV check is the lease's: a handoff the router stranded would still be held after it; a
handoff abandoned by design (a killed worker's) ends with it.

Usage: ``python -m perf.chaos --soak-minutes 30 --concurrency 256 --out DIR``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import Counter
from typing import Any

import aiohttp

from perf.chaos import checks
from perf.chaos.driver import ENGINE_EVENTS, LEASE_S, MAX_FDS_GROWTH, MAX_RSS_GROWTH_KB, PROCESS_EVENTS, Chaos
from perf.chaos.faults import (
    CLIENT_SLACK_S,
    CONSUMERS,
    DEADLINE_S,
    KINDS,
    NO_ENGINE_BACKOFF_S,
    PRODUCERS,
    clean_expectation,
    make_expectation,
)

EVENT_EVERY_S = 20.0
SAMPLE_EVERY_S = 60.0
FAULT_FRACTION = 0.3


async def _drive(chaos: Chaos, seconds: float, concurrency: int, engine_events: list[str],
                 process_events: list[str], rep: dict[str, Any]) -> None:
    assert chaos.router is not None and chaos.fleet is not None
    master = chaos.router.proc.pid
    outcomes: Counter[str] = Counter()
    violations: list[str] = []
    ids = itertools.count()
    kinds: list[str] = []
    end = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S + CLIENT_SLACK_S)

    def expectation() -> Any:
        nonlocal kinds
        if chaos.rng.random() < FAULT_FRACTION:
            if not kinds:
                kinds = list(KINDS)
                chaos.rng.shuffle(kinds)
            return make_expectation(chaos.rng, PRODUCERS, CONSUMERS, kinds.pop())
        return clean_expectation(chaos.rng)

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client() -> None:
            while time.monotonic() < end:
                res = await chaos.one(session, next(ids), expectation(), chaos.rng.random() < 0.3)
                outcomes[res.outcome] += 1
                if res.verdict == "violation" and len(violations) < 20:
                    violations.append(f"#{res.idx} {res.kind}: {res.outcome} {res.problem}")
                if res.outcome == "http:503:no_engine":
                    await asyncio.sleep(NO_ENGINE_BACKOFF_S)

        async def faults() -> None:
            for i in itertools.count():
                await asyncio.sleep(EVENT_EVERY_S)
                if time.monotonic() > end - EVENT_EVERY_S:
                    return
                if i % 2 == 0:
                    await chaos.engine_event(engine_events[(i // 2) % len(engine_events)])
                else:
                    await chaos.process_event(process_events[(i // 2) % len(process_events)])

        async def sample() -> None:
            while time.monotonic() < end:
                held = sum(chaos.fleet.stats(p)["held_blocks"] for p in PRODUCERS)  # type: ignore[union-attr]
                rep["samples"].append({"t_s": round(seconds - (end - time.monotonic())), "held_blocks": held,
                                       **checks.resources(master)})
                await asyncio.sleep(max(min(SAMPLE_EVERY_S, end - time.monotonic()), 0.0))

        await asyncio.gather(*(client() for _ in range(concurrency)), faults(), sample())
    rep["outcomes"], rep["violations"] = dict(outcomes), violations
    rep["requests"] = sum(outcomes.values())


def run_soak(chaos: Chaos, minutes: float, concurrency: int) -> dict[str, Any]:
    """The soak on ``chaos`` (not started yet); always stops what it started."""

    rep: dict[str, Any] = {"minutes": minutes, "concurrency": concurrency, "samples": [], "failed": []}
    try:
        os.makedirs(os.path.join(chaos.args.out, "soak"), exist_ok=True)
        chaos.start(out=os.path.join(chaos.args.out, "soak"))
        assert chaos.router is not None and chaos.fleet is not None
        started = time.monotonic()
        asyncio.run(_drive(chaos, minutes * 60, concurrency, list(ENGINE_EVENTS), list(PROCESS_EVENTS), rep))
        rep["duration_s"] = round(time.monotonic() - started, 1)
        for name in PRODUCERS + CONSUMERS:  # faults cleared, every engine serving
            chaos.control("DELETE", f"/engines/{name}/faults")
            chaos.control("POST", f"/engines/{name}/start")
        fleet = chaos.fleet
        checks.wait_for(lambda: sum(fleet.stats(p)["held_blocks"] for p in PRODUCERS) == 0, LEASE_S + 10)
        rep["held_blocks_after_lease"] = sum(fleet.stats(p)["held_blocks"] for p in PRODUCERS)
        rep["end"] = checks.resources(chaos.router.proc.pid)
    finally:
        chaos.stop()
    first = {k: v for k, v in rep["samples"][0].items() if k not in ("t_s", "held_blocks")} if rep["samples"] else {}
    rep["failed"] = [f"{len(rep.get('violations', []))}+ replies outside the contract: {rep['violations'][:3]}"] \
        if rep.get("violations") else []
    if rep.get("held_blocks_after_lease"):
        rep["failed"].append(f"{rep['held_blocks_after_lease']} KV blocks still held after the lease")
    if first and "end" in rep:
        rep["failed"] += checks.resource_problems(first, rep["end"], MAX_FDS_GROWTH, MAX_RSS_GROWTH_KB)
    return rep


def _role(role: str, procs: list[dict[str, int]]) -> str:
    return f"{role} fds {[p['fds'] for p in procs]} RSS MB {[round(p['rss_kb'] / 1024, 1) for p in procs]}"


def print_soak(rep: dict[str, Any]) -> None:
    """One line per sample, then the verdict."""
    print(f"soak: {rep.get('requests')} requests in {rep.get('duration_s')} s at concurrency {rep['concurrency']}; "
          f"outcomes {rep.get('outcomes')}")
    for s in rep["samples"]:
        roles = "  ".join(_role(role, s[role]) for role in ("master", "worker", "supervisor") if role in s)
        print(f"  t={s['t_s']:>5}s held KV blocks {s['held_blocks']:>5}  {roles}")
    print(f"  held KV blocks after the lease: {rep.get('held_blocks_after_lease')}")
    for line in rep["failed"]:
        print(f"  FAILED: {line}")
