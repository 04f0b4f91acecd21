"""Preflight at start-up (docs/behaviour.md "Recovery", ``preflight.on_start``): failing engines start ejected.

Runs in the gunicorn master inside ``on_starting``, before the supervisor and the workers
exist, so no request is ever placed on an engine that failed it. The verdicts are written as
the engines' first records (no other writer exists yet); the supervisor takes them over like
any published state, so those engines are probed back in at the readmission cadence. An
engine failing preflight never stops the router; an invalid contract already stopped it
when the settings were loaded.
"""

from __future__ import annotations

import asyncio
import sys
import time

from narwhal.fleet import Fleet
from narwhal.logs import json_line
from narwhal.preflight.check import run_preflight
from narwhal.settings import Settings
from narwhal.shm.records import RECORD_UNREACHABLE, EngineRecord, write_record
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.supervisor.breaker import State


def preflight_on_start(shared: SharedFleet, settings: Settings) -> set[str]:
    """Master, before any fork: run preflight, print it, publish failed engines EJECTED; their names."""
    json_mode = settings.log.format == "json"

    def progress(line: str) -> None:  # each engine and pair as it ends: a long run is never silent
        print(json_line("info", "narwhal.preflight", line) if json_mode else line, file=sys.stderr, flush=True)

    report = asyncio.run(run_preflight(settings, progress=progress))
    failed = report.failed_engines()
    if settings.log.format == "json":  # one JSON line, the report as data, like every other line
        level = "info" if report.ok else "warning"
        line = json_line(level, "narwhal.preflight", report.summary(), preflight=report.to_dict())
        print(line, file=sys.stderr, flush=True)
    else:
        print(report.table(), file=sys.stderr, flush=True)
    now = time.time()
    unreachable = report.unreachable_engines()  # said so from the first record (the supervisor takes it over)
    version = shared.generation + 1  # the generation bumped below (shm.records)
    for engine in Fleet(settings).engines:
        bad = engine.name in failed
        at = shared.engine_slot(engine.name, engine.url)  # assigned by the master just before
        if at is None:
            continue
        write_record(
            shared.region,
            at,
            EngineRecord(
                version=version,
                state=int(State.EJECTED if bad else State.ADMITTED),
                failure_streak=0,
                ejections=1 if bad else 0,
                quarantined_until=None,
                last_failure_reason="preflight" if bad else None,
                last_failure_at=now if bad else None,
                name_hash=record_hash(engine.name, engine.url),
                flags=RECORD_UNREACHABLE if engine.name in unreachable else 0,
            ),
        )
    shared.bump_generation()
    return failed
