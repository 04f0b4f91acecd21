"""The supervisor's load reads (docs/behaviour.md "Placement"): in parallel, never waited for, failures publish
nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.engines.control import ControlError
from narwhal.fleet import Fleet
from narwhal.settings import Settings
from narwhal.shm.records import read_load
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.supervisor.load import LoadReader

GOOD = 'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_waiting{engine="0"} 1\n' \
       'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'


class Control:
    """Answers per engine name: a body, an error, or a hang until released."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.release = asyncio.Event()

    async def get(self, engine: Any, path: str) -> tuple[int, bytes]:
        assert path == "/metrics"
        self.calls[engine.name] += 1
        if engine.name == "ok":
            return 200, GOOD.encode()
        if engine.name == "down":
            raise ControlError("unreachable")
        if engine.name == "html":
            return 200, b"<html>bad gateway</html>"
        if engine.name == "five":
            return 503, b""
        await self.release.wait()  # "hung"
        return 200, GOOD.encode()


@pytest.fixture
def shared() -> Iterator[SharedFleet]:
    fleet = SharedFleet.create(engines=8, slots=2, ring=8)
    yield fleet
    fleet.close()


async def test_a_round_returns_at_once_and_publishes_only_good_readings(shared: SharedFleet) -> None:
    names = ["ok", "down", "html", "five", "hung"]
    fleet = Fleet(Settings(engines=[{"name": n, "role": "consumer", "url": f"http://127.0.0.1:{i + 1}"}
                                    for i, n in enumerate(names)]))
    shared.assign_engines([(e.name, e.url) for e in fleet.engines])  # what the master does at start
    slot = shared.claim_slot(4321)
    assert slot is not None
    shared.set_count(slot, 0, 0, 1)  # one prefill and three decode slots of this host on "ok",
    shared.set_count(slot, 0, 1, 3)
    shared.region.set_u32(shared.layout.unsent_offset(slot, 0), 1)  # one of them for a prefill still running
    control = Control()
    reader = LoadReader(shared, control)  # type: ignore[arg-type]
    reader.start_round(fleet.engines)  # returns without awaiting any read
    for _ in range(50):
        await asyncio.sleep(0)
    assert read_load(shared.region, 0) is None and shared.load_generation == 0  # read, not yet published
    shared.publish_loads(reader.take())  # the loop's next pass
    ok = read_load(shared.region, 0)
    assert ok is not None and (ok.running, ok.waiting, ok.kv_usage, ok.name_hash) == (3.0, 1.0, 0.5, record_hash("ok", "http://127.0.0.1:1"))
    assert ok.ours == 3.0  # this host's legs on the engine when the answer came, those it can have seen
    assert [read_load(shared.region, i) for i in range(1, 5)] == [None] * 4
    assert shared.load_generation == 1
    reader.start_round(fleet.engines)  # the hung read is still running: not started twice
    for _ in range(50):
        await asyncio.sleep(0)
    assert control.calls == Counter({"ok": 2, "down": 2, "html": 2, "five": 2, "hung": 1})
    shared.publish_loads(reader.take())
    assert shared.load_generation == 2
    control.release.set()
    for _ in range(50):
        await asyncio.sleep(0)
    shared.publish_loads(reader.take())
    shared.publish_loads(reader.take())  # nothing came since: no bump
    assert read_load(shared.region, 4) is not None and shared.load_generation == 3
    reader.cancel()


async def test_a_flapping_engine_logs_once_a_minute(shared: SharedFleet, caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(Settings(engines=[{"name": "flap", "role": "consumer", "url": "http://127.0.0.1:1"}]))

    class Flapping:
        def __init__(self) -> None:
            self.fail = True

        async def get(self, engine: Any, path: str) -> tuple[int, bytes]:
            if self.fail:
                raise ControlError("timed out after 0.1s")
            return 200, GOOD.encode()

    control = Flapping()
    shared.assign_engines([(e.name, e.url) for e in fleet.engines])
    reader = LoadReader(shared, control)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="narwhal.supervisor.load")
    for _ in range(4):  # fail, recover, fail, recover ... within a minute
        for fail in (True, False):
            control.fail = fail
            reader.start_round(fleet.engines)
            for _ in range(20):
                await asyncio.sleep(0)
            shared.publish_loads(reader.take())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["load of flap not read (timed out after 0.1s): placement uses its in-flight counts only"]
    assert read_load(shared.region, 0) is not None  # the good reads were published all along
    reader.cancel()


async def test_each_reading_gives_the_holdings_its_capacity_and_prefill_counters(shared: SharedFleet) -> None:
    from narwhal.supervisor.load_metrics import PrefillCounters

    fleet = Fleet(Settings(engines=[{"name": "p", "role": "producer", "url": "http://127.0.0.1:1"}]))
    body = GOOD + (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 7.0\n'
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.5\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 900.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0\n'
    )

    class Answer:
        async def get(self, engine: Any, path: str) -> tuple[int, bytes]:
            return 200, body.encode()

    seen: list[tuple[int, int | None, PrefillCounters | None]] = []
    shared.assign_engines([(e.name, e.url) for e in fleet.engines])
    reader = LoadReader(shared, Answer(), on_reading=lambda i, cap, counters, at: seen.append((i, cap, counters)))  # type: ignore[arg-type]
    reader.start_round(fleet.engines)
    for _ in range(20):
        await asyncio.sleep(0)
    assert seen == [(0, 1600, PrefillCounters(0.5, 7.0, 900.0, 100.0))]
    reader.cancel()
