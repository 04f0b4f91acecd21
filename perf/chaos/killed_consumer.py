"""A consumer killed under load: every stream running on it completes (docs/behaviour.md "Migration").

The sequence: ``concurrency`` clients send slow clean streams (a token every
:data:`TOKEN_DELAY_S`, :data:`TOKENS` of them: each stream runs for seconds) through a fresh
fleet (2 producers, 2 consumers); a few seconds in, one consumer is stopped — its open streams
are cut mid-way, and it refuses every connection after. With migrations on, each cut stream
continues on the other consumer: every request that got its 200 must end with its full stream,
every token once (the fake continues exactly where the output stopped, and ``classify`` checks
the count). A terminal event is a violation. A request that met the dead consumer before its
first token may fail as docs/behaviour.md's failure table permits (502 ``engine_unreachable``
past its one retry): counted, not judged. Afterwards the consumer serves again, nothing is
held and no handoff is stranded.

Why ``retry_budget_ratio`` 0.6: a continuation takes the request's slot in the fleet-wide retry
budget, as a retry does, and a lost consumer of two cuts about half the streams in flight at
once. The budget must cover one consumer's share of the streams for all of them to continue —
the guide's advice for fleets that want every stream of a lost consumer carried (docs/
behaviour.md "Migration").
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp

from perf.chaos import storm
from perf.chaos.driver import Chaos
from perf.chaos.faults import CLIENT_SLACK_S, CONSUMERS, DEADLINE_S, Expectation, Result

TOKENS = 24
TOKEN_DELAY_S = 0.1
KILL_AFTER_S = 3.0
RECOVERY: dict[str, Any] = {"max_migrations": 1, "retry_budget_ratio": 0.6, "max_retries": 1,
                            "eject_after": 3, "failure_quarantine_s": 1.0}


def _slow_stream() -> Expectation:
    return Expectation("slow_stream", {"decode": {"token_delay_s": TOKEN_DELAY_S}}, TOKENS, TOKENS)


async def _drive(chaos: Chaos, seconds: float, concurrency: int, victim: str) -> tuple[list[Result], float]:
    results: list[Result] = []
    ids = itertools.count()
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S + CLIENT_SLACK_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        until = time.monotonic() + seconds

        async def client(n: int) -> None:
            while time.monotonic() < until:
                results.append(await chaos.one(session, next(ids), _slow_stream(), chat=n % 2 == 0))

        async def kill() -> float:
            await asyncio.sleep(KILL_AFTER_S)
            chaos.open_window("stop_consumer", victim)
            await asyncio.to_thread(chaos.control, "POST", f"/engines/{victim}/stop")
            return time.monotonic()

        killer = asyncio.create_task(kill())
        await asyncio.gather(*(client(n) for n in range(concurrency)))
        killed_at = await killer
    return results, killed_at


def run_killed_consumer(chaos: Chaos, seconds: float, concurrency: int) -> dict[str, Any]:
    """The whole sequence on ``chaos`` (not started yet); always stops what it started."""
    victim = CONSUMERS[0]
    rep: dict[str, Any] = {"victim": victim, "seconds": seconds, "concurrency": concurrency,
                           **{f"recovery.{k}": v for k, v in RECOVERY.items()}}
    try:
        out = os.path.join(chaos.args.out, "killed-consumer")
        os.makedirs(out, exist_ok=True)
        chaos.start(recovery=RECOVERY, out=out)
        results, killed_at = asyncio.run(_drive(chaos, seconds, concurrency, victim))
        chaos.control("POST", f"/engines/{victim}/start")
        running = [r for r in results if r.start < killed_at < r.end]  # in flight when it died
        rep.update({
            "requests": len(results),
            "in_flight_at_kill": len(running),
            "outcomes": dict(Counter(r.outcome for r in results)),
            "cut_streams": sum(r.outcome.startswith("term:") for r in results),
            "full_streams_in_flight_at_kill": sum(r.outcome == "ok" and r.tokens == TOKENS for r in running),
        })
        rep["migrations"] = _migrations(chaos)
        rep["leaks"], rep["kv"] = storm.after_checks(chaos)  # every engine back, nothing held or stranded
    finally:
        chaos.stop()
    rep["failed"] = verdict(rep)
    return rep


def _migrations(chaos: Chaos) -> float:
    assert chaos.router is not None
    with urllib.request.urlopen(chaos.router.url + "/metrics", timeout=5) as resp:  # noqa: S310 (127.0.0.1)
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("narwhal_migrations_total{"))


def verdict(rep: dict[str, Any]) -> list[str]:
    """Why the sequence fails (empty: it passed)."""
    failed = list(rep.get("leaks", []))
    if not rep.get("in_flight_at_kill"):
        failed.append("no stream was in flight when the consumer died: the sequence did not happen")
    if rep.get("cut_streams"):
        failed.append(f"{rep['cut_streams']} streams ended with a terminal event: {rep.get('outcomes')}")
    if rep.get("migrations", 0) < 1:
        failed.append("no stream migrated")
    return failed


def print_killed_consumer(rep: dict[str, Any]) -> None:
    """The sequence's figures and why it failed, if it did."""
    print(f"killed consumer: {rep['victim']} stopped under {rep['concurrency']} slow streams: "
          f"{rep.get('in_flight_at_kill')} in flight, {rep.get('full_streams_in_flight_at_kill')} of them completed "
          f"whole, {rep.get('migrations')} migrations, {rep.get('cut_streams')} cut; outcomes {rep.get('outcomes')}")
    for line in rep["failed"]:
        print(f"  FAILED: {line}")
