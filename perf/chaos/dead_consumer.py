"""A dead consumer must not take the traffic (docs/behaviour.md "Recovery" round 4).

The sequence: consumer d0 is ejected for stream faults (it cuts every stream after the first
token), then healed, its readmission probe still seconds away; then consumer d1 is killed (it
refuses every connection). ``max_ejected_fraction = 0.5`` keeps d1 in the fleet. Before the fix
every request went to the dead d1 (a refusing engine fails fast and looks least loaded) and was
answered 502 while d0, alive and healthy, was held out: 300 of 300 in 0.26 s. Now d1 is
unreachable and comes last, after d0, which is ejected but reachable, so the clean requests sent
while d1 is down are served: at least :data:`MIN_CLEAN_SHARE` of them. The first requests to meet
d1 dead fail as docs/behaviour.md "Failure semantics" permits (502 ``engine_unreachable``): the share is what is judged.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

from perf.chaos import checks, storm
from perf.chaos.driver import Chaos
from perf.chaos.faults import ADMIN_TOKEN, CONSUMERS

MIN_CLEAN_SHARE = 0.99
RECOVERY: dict[str, Any] = {"failure_quarantine_s": 1.0, "max_retries": 1, "eject_after": 3,
                            "max_ejected_fraction": 0.5, "readmit_interval_s": 30, "readmit_interval_max_s": 30}


def _state(chaos: Chaos, name: str) -> str:
    assert chaos.router is not None
    return str(next(e["state"] for e in checks.admin_engines(chaos.router.url, ADMIN_TOKEN) if e["name"] == name))


def run_dead_consumer(chaos: Chaos, seconds: float, concurrency: int) -> dict[str, Any]:
    """The whole sequence on ``chaos`` (not started yet); always stops what it started."""
    faulty, dead = CONSUMERS[0], CONSUMERS[1]
    rng = random.Random(chaos.args.seed + 3)
    rep: dict[str, Any] = {"faulty": faulty, "dead": dead, "seconds": seconds, "concurrency": concurrency,
                           **{f"recovery.{k}": v for k, v in RECOVERY.items()}}
    try:
        out = os.path.join(chaos.args.out, "dead-consumer")
        os.makedirs(out, exist_ok=True)
        chaos.start(recovery=RECOVERY, out=out)
        chaos.control("PUT", f"/engines/{faulty}/faults", {"decode": {"close_after": 1}})
        end = time.monotonic() + 20
        while _state(chaos, faulty) != "ejected" and time.monotonic() < end:
            asyncio.run(storm.drive(chaos, 0.5, 4, 0.0, rng))
        rep["ejected"] = _state(chaos, faulty) == "ejected"
        chaos.control("DELETE", f"/engines/{faulty}/faults")  # healed; its probe is 30 s away
        chaos.control("POST", f"/engines/{dead}/stop")
        results, start, stop = asyncio.run(storm.drive(chaos, seconds, concurrency, 0.0, rng))
        rep.update(storm.summarize(results, 0.5))
        rep["duration_s"] = round(stop - start, 1)
        chaos.control("POST", f"/engines/{dead}/start")
    finally:
        chaos.stop()
    rep["failed"] = verdict(rep)
    return rep


def verdict(rep: dict[str, Any]) -> list[str]:
    """Why the sequence fails (empty: it passed)."""
    failed = []
    if not rep["ejected"]:
        failed.append(f"{rep['faulty']} was never ejected: the sequence did not happen")
    # The requests in flight to the dead consumer when it dies, and the first each client sends
    # before it is known unreachable, fail as docs/behaviour.md "Failure semantics" permits (502 engine_unreachable,
    # past the
    # retry budget): the share is the judged figure, not each reply.
    if rep.get("clean_success_share", 0.0) < MIN_CLEAN_SHARE:
        failed.append(f"clean_success_share {rep.get('clean_success_share')} < {MIN_CLEAN_SHARE} "
                      f"with {rep['dead']} dead and {rep['faulty']} ejected: {rep.get('clean_failures')}")
    return failed


def print_dead_consumer(rep: dict[str, Any]) -> None:
    """The sequence's figure and why it failed, if it did."""
    print(f"dead consumer: {rep['faulty']} ejected for stream faults, {rep['dead']} killed: "
          f"clean_success_share {rep.get('clean_success_share')} ({rep.get('clean_ok')} of {rep.get('clean')}) "
          f"in {rep.get('duration_s')} s at concurrency {rep['concurrency']}")
    for line in rep["failed"]:
        print(f"  FAILED: {line}")
