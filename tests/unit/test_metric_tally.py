"""The metric tally (narwhal.metric_tally): bulk writes give exactly what direct updates give."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from narwhal import metric_tally
from narwhal.metric_tally import Tally

BOUNDS = (0.005, 0.01, 0.1, 1.0)
# On a bound, just above, below the first, beyond the last, and a repeat.
SAMPLES = (0.005, 0.0051, 0.001, 7.5, 0.1, 0.1, 0.99)


def _series(registry: CollectorRegistry) -> tuple[Counter, Counter, Histogram]:
    plain = Counter("things_total", "t", registry=registry)
    labelled = Counter("kinds_total", "k", ["kind"], registry=registry)
    hist = Histogram("gap_seconds", "g", buckets=BOUNDS, registry=registry)
    return plain, labelled, hist


def _exposition(registry: CollectorRegistry) -> list[str]:
    # The _created timestamps differ between two registries; every other line must not.
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_a_flush_writes_what_direct_updates_would() -> None:
    direct, tallied = CollectorRegistry(), CollectorRegistry()
    d_plain, d_labelled, d_hist = _series(direct)
    t_plain, t_labelled, t_hist = _series(tallied)
    tally = Tally()
    pending = tally.histogram(t_hist)
    for i, value in enumerate(SAMPLES):
        d_plain.inc()
        d_labelled.labels("a" if i % 2 else "b").inc(3)
        d_hist.observe(value)
        tally.inc(t_plain)
        tally.inc(t_labelled.labels("a" if i % 2 else "b"), 3)
        tally.observe(pending, value)
    assert _exposition(direct) != _exposition(tallied)  # nothing written before the flush
    tally.flush()
    assert _exposition(direct) == _exposition(tallied)
    tally.flush()  # a second flush adds nothing
    assert _exposition(direct) == _exposition(tallied)
    d_hist.observe(0.02)
    tally.observe(pending, 0.02)
    tally.flush()
    assert _exposition(direct) == _exposition(tallied)


def test_a_histogram_without_the_expected_internals_is_observed_directly() -> None:
    registry = CollectorRegistry()
    hist = Histogram("odd_seconds", "o", buckets=BOUNDS, registry=registry)
    tally = Tally()
    pending = tally.histogram(hist)
    pending.direct = True  # what registration decides when prometheus_client lacks _upper_bounds
    tally.observe(pending, 0.5)
    assert registry.get_sample_value("odd_seconds_count") == 1.0  # at once, not at the flush
    tally.flush()
    assert registry.get_sample_value("odd_seconds_count") == 1.0


async def test_the_flush_loop_writes_within_its_period(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metric_tally, "FLUSH_S", 0.01)
    registry = CollectorRegistry()
    counter = Counter("loop_total", "l", registry=registry)
    tally = Tally()
    task = asyncio.ensure_future(tally.keep_flushing())
    try:
        tally.inc(counter, 2)
        for _ in range(500):  # bounded wait on the condition, not a fixed sleep
            if registry.get_sample_value("loop_total") == 2.0:
                break
            await asyncio.sleep(0.01)
        assert registry.get_sample_value("loop_total") == 2.0
    finally:
        task.cancel()



def test_a_negative_count_is_dropped_and_the_rest_of_the_flush_written() -> None:
    # Counter.inc(-n) raised in the flush, losing the counts swapped out with it.
    registry = CollectorRegistry()
    plain, labelled, _ = _series(registry)
    tally = Tally()
    tally.inc(labelled.labels("bad"), -5)
    tally.inc(plain, 3)
    tally.flush()
    assert registry.get_sample_value("things_total") == 3.0
    assert registry.get_sample_value("kinds_total", {"kind": "bad"}) == 0.0
