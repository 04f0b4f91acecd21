"""The supervisor's heartbeat while a round of engine reads runs: the real loop
(``Supervisor.run``) on a real shared region, its ``/metrics`` reads answered in-process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.engines.control import PooledReader
from narwhal.settings import Settings
from narwhal.shm.shared import SharedFleet
from narwhal.supervisor.edge import Supervisor
from narwhal.supervisor.loop import run
from narwhal.supervisor.rounds import BATCH, Rounds

ENGINES = 64
READ_CPU_S = 0.015  # each read's work once answered: a large /metrics body to parse, a busy host
BODY = b'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'


@pytest.fixture
def shared() -> Iterator[SharedFleet]:
    region = SharedFleet.create(engines=ENGINES, slots=2)
    yield region
    region.close()


async def test_beats_go_on_while_a_round_of_reads_of_a_large_fleet_runs(
    shared: SharedFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings.model_validate({
        "server": {"max_engines": ENGINES},
        "recovery": {"health_interval_s": 3600},
        "placement": {"load_interval_s": 1.0},
        "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{i + 1}", "role": "consumer"} for i in range(ENGINES)],
    })
    reads = 0

    async def get(self: PooledReader, engine: Any, path: str) -> tuple[int, bytes]:
        nonlocal reads
        time.sleep(READ_CPU_S)  # the loop's thread is busy with this read: what a round costs it
        reads += 1
        return 200, BODY

    beats: list[float] = []
    real_beat = shared.beat
    monkeypatch.setattr(PooledReader, "get", get)
    monkeypatch.setattr(shared, "beat", lambda pid: (beats.append(time.monotonic()), real_beat(pid)))
    shared.assign_engines([(e["name"], e["url"]) for e in settings.model_dump()["engines"]])
    task = asyncio.ensure_future(run(Supervisor(shared, settings)))
    try:
        end = time.monotonic() + 20
        while reads < ENGINES and time.monotonic() < end:
            await asyncio.sleep(0.01)
        # The whole first round, ~1 s of the loop's time: the second starts at 1 s, so on a busy
        # host (or beside the start's other reads: the engines' models) a batch of it may be in too.
        assert reads >= ENGINES
        after = len(beats) + 3
        while len(beats) < after and time.monotonic() < end:  # and the beats after it
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    gap = max(b - a for a, b in zip(beats, beats[1:], strict=False))
    # All at once, the round held the loop for ENGINES × READ_CPU_S (0.96 s) between two beats;
    # a batch at a time, for BATCH × READ_CPU_S (0.12 s) plus the loop's own period.
    assert gap < 0.5, f"longest gap between beats {gap:.3f}s"


def _passes(rounds: Rounds, started: list[int], passes: int) -> list[list[int]]:
    """What each of ``passes`` calls of ``rounds.run`` started (each start appends its number to ``started``)."""
    per_pass: list[list[int]] = []
    for _ in range(passes):
        before = len(started)
        rounds.run()
        per_pass.append(started[before:])
    return per_pass


def _round(rounds: Rounds, started: list[int], numbers: range, within_s: float) -> None:
    rounds.spread([lambda i=i: started.append(i) for i in numbers], within_s)


def test_a_spread_round_starts_everything_a_batch_per_pass() -> None:
    rounds, started = Rounds(0.02), []
    _round(rounds, started, range(3 * BATCH + 1), 1.0)
    per_pass = _passes(rounds, started, 5)
    assert [len(p) for p in per_pass] == [BATCH, BATCH, BATCH, 1, 0]
    assert started == list(range(3 * BATCH + 1))


def test_a_round_with_more_batches_than_passes_in_its_time_starts_more_per_pass() -> None:
    rounds, started = Rounds(0.02), []
    _round(rounds, started, range(4 * BATCH), 0.05)  # two passes in 50 ms: four batches in two
    assert [len(p) for p in _passes(rounds, started, 3)] == [2 * BATCH, 2 * BATCH, 0]


def test_rounds_under_way_each_start_their_next_batch_every_pass() -> None:
    rounds, started = Rounds(0.02), []
    _round(rounds, started, range(2 * BATCH), 1.0)
    _round(rounds, started, range(100, 103), 1.0)
    per_pass = _passes(rounds, started, 3)
    assert per_pass == [list(range(BATCH)) + [100, 101, 102], list(range(BATCH, 2 * BATCH)), []]
